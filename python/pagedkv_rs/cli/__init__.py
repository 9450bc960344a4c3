"""The ``pagedkv`` command: ``main.py`` dispatches to one module per command (``generate``, ``simulate``,
``bench/``); ``args.py`` holds the model and KV-cache options the commands that build an ``LLM`` share."""
