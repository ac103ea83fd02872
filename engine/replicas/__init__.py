"""Data parallelism: several engine replicas, each in its own process, behind one front end.

``router`` picks a replica for each request (prefix affinity balanced with load);
``replica`` is the body of a replica process (a whole engine: scheduler, KV pages,
runner, and with ``--tp`` its own tensor-parallel ranks); ``front`` is what the HTTP
layer holds instead of an ``Engine``: it speaks the same interface and forwards each
request, its outputs and its cancellation over a pipe to the replica that serves it.
"""
