"""`diag launch`: torchrun's launcher (torch.distributed.elastic) with another worker policy:
a worker that dies while the others run is replaced alone, by a warm spare, when its rank
recovers in place (diag.trainer.resilient); otherwise every worker restarts, as under torchrun.
It runs next to the ranks and may import torch; it is not the agent."""
