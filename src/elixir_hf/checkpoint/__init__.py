"""The checkpoint of an Elixir run: what it holds and how it is written, verified and read back.

``format``: the folder's layout, atomic and fsynced writes, the marker (sizes and CRC-32s, written
last) and the checks a resume runs first; ``optimizer_files``: the optimizer state by parameter name;
``convert``: a checkpoint as a plain PyTorch one; ``folder_lock``: one job per output folder;
``restart``: ``get_last_checkpoint`` that skips torn checkpoints.
"""
