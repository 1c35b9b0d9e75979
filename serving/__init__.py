"""Ray Serve applications: a trained policy behind the OpenAI API (``policy.py``: completions, chat,
streaming, best-of-n, checkpoint reload), a scorer behind ``/v1/score`` (``scorer.py``), the API
key and request limits they share (``common.py``) and ``rayrlhf serve`` (``cli.py``)."""
