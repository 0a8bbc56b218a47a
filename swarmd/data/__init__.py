"""Training data: documents -> tokens -> a token cache -> held-out and shuffled, sharded windows.

``records`` (what a file holds), ``hf`` (Hugging Face datasets, optional), ``corpus`` (which
files, their listing), ``fingerprint`` and ``tokenfile`` (the token cache), ``heldout`` and
``windows`` (the held-out split), ``order`` (shards and the seeded order), ``prefetch`` (batches
made on a thread), ``stream`` and ``streamed`` (the streamed fallback), ``pipeline``
(:func:`~swarmd.data.pipeline.open_data`, what a trainer reads). docs/data.md tells the story.
Pure cores: ``order``, ``heldout``, ``fingerprint``. Never imports pipeline/, node/ or
training/ (the tokenizer is passed in).
"""
