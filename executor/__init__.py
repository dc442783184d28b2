"""Executor: replays a plan's static schedule every training step."""
