"""The execution half of the engine: turning a scheduled batch into sampled tokens.

The model definition (weights, embedding, LM head), the backends that run its layers
(``backends/``: the CPU fast path, Triton or reference kernels, one registry), weight
loading, the runner, CUDA graphs and the sampler. Nothing here knows about requests'
channels or HTTP.
"""
