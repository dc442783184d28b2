"""`all-gpu`: everything resident on the GPU, optimizer on the GPU (the no-offload baseline)."""
from tensorstow.schema.schedule import BlockDecision, Decisions


def plan(problem) -> Decisions:
    d = BlockDecision(params="gpu", states="gpu", optimizer="gpu", activations="keep", checkpoint="gpu")
    return Decisions(policy="all-gpu", blocks={b: d for b in problem.order},
                     notes=("every tensor stays on the GPU for the whole step",))
