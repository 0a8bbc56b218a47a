"""Models behind one seam (:mod:`swarmd.models.seam`): the built-in GPT, Hugging Face causal
LMs, or a user's own selected by ``model.factory``."""
