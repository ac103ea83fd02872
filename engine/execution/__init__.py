"""The execution half of the engine: turning a scheduled batch into sampled tokens.

The model definition, attention backends, weight loading, the runner, CUDA
graphs and the sampler. Nothing here knows about requests' channels or HTTP.
"""
