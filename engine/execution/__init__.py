"""The execution half of the engine: turning a scheduled batch into sampled tokens.

It flows one way, top to bottom: ``launch`` (starts the tensor-parallel ranks, joins
their group, then loads) -> ``model_runner`` -> ``loading`` (picks the dtype and the
backend, from the one registry, and hands it to the model) -> ``llama`` -> ``backends``,
``parallel`` -> ``layers``, ``rope``, ``sampler``, ``shape``. It meets the scheduling
half only through the step records of ``trillm.engine.step``. Nothing here knows about
requests' channels or HTTP.
"""
