"""Tensor parallelism: a model's layers split over ranks of a ``torch.distributed`` group.

``sharding`` says which heads, columns and vocabulary rows each rank holds and
cuts checkpoint weights to match; ``group`` holds the collectives the forward pass
needs (an all-reduce after each row-parallel projection, a gather of the logits);
``workers`` starts and feeds the ranks that only compute.
"""
