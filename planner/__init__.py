"""Planner: hardware specs, cost model, policies, simulator, plan JSON and the CLI."""
