"""The plan's contract: typed, immutable data that the planner writes and the executor reads.

`schema.hardware` (machine specs), `schema.options` (what a plan was asked for),
`schema.schedule` (decisions, buffers, instructions, and the names of buffer kinds, tiers and
streams) and `schema.plan` (the plan file, strict JSON (de)serialization with a schema version).
It imports nothing of the planner, the executor or the calibration above it.
"""
