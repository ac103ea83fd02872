"""Tensor parallelism: a model's layers split over ranks of a ``torch.distributed`` group.

``sharding`` says which heads, columns and vocabulary rows each rank holds and
cuts checkpoint weights to match; ``group`` holds the collectives the forward pass
needs (an all-reduce after each row-parallel projection, a gather of the logits);
``topology`` says where a rank sits and joins the groups; ``channel`` carries each step
from rank 0 to the others. Starting the ranks is ``execution/launch.py``'s, above all this.
"""
