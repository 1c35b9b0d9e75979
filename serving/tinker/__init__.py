"""The Tinker API as a training service (``rayrlhf serve trainer``): users drive their own training
loops with the official ``tinker`` SDK or ``tinker-cookbook`` against rayrlhf's learners and vLLM.

``app.py`` routes HTTP, ``service.py`` holds sessions, models and futures, ``futures.py`` orders
and awaits calls, ``wire.py`` reads and writes the API's protobuf payloads. The roles behind it
are ``actors/lora_tenants.py`` (many LoRA adapters on one base model) and
``actors/rollout/adapter_sampler.py`` (vLLM's multi-LoRA sampling); its losses are
``learners/objectives/tinker_losses.py``.
"""
