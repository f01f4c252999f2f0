"""A model for the engine without a full copy of it per rank in host memory.

``model``: ``from_pretrained`` / ``from_config`` (the weights streamed, or read on rank 0 and the
same model on meta elsewhere; a new model's init drawn in each rank's shards); ``stream``:
transformers' loader with the reads left out, the weights left in their files for the engine;
``hub``: a Hub id as its snapshot folder in the HF cache, downloaded once per host.
"""
