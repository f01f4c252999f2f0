"""Run under ``torchrun --nproc_per_node 2`` by ``test_hub.py``: ``elixir_hf.from_pretrained`` of a Hub
id before any process group exists, online with the network replaced (``helpers.hub.FakeHub``), the
cache at ``HF_HUB_CACHE``. Each rank writes its downloads, its wait for its host's download (is the
snapshot in the cache when the wait returns?) and its load, in order, to ``<out>/rank<RANK>.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/: helpers

import huggingface_hub  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import elixir_hf  # noqa: E402
from elixir_hf.loading import hub  # noqa: E402
from elixir_runtime.weights.attached import attached_weights  # noqa: E402
from helpers.hub import FakeHub, snapshot_path  # noqa: E402

REPO = "org/tiny"


def main(repo_folder: str, out: str) -> None:
    events: list = []
    huggingface_hub.constants.HF_HUB_OFFLINE = False
    huggingface_hub.snapshot_download = FakeHub({REPO: Path(repo_folder)}, events)
    snapshot = snapshot_path(Path(huggingface_hub.constants.HF_HUB_CACHE), REPO)
    waiter = hub._waiter

    def recorded(call: int):
        wait = waiter(call)

        def waited(message, downloader):
            result = wait(message, downloader)
            events.append(("waited", (snapshot / hub.INDEX_FILE).is_file()))
            return result

        return waited if wait is not None else None

    hub._waiter = recorded
    model = elixir_hf.from_pretrained(AutoModelForCausalLM, REPO, dtype=torch.float32)
    events.append(("loaded", attached_weights(model).origin, dist.is_initialized()))
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(events))


if __name__ == "__main__":
    main(*sys.argv[1:3])
