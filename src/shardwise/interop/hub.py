"""Hub names given where a local path is expected: the two-line recipe to fetch them.

shardwise never touches the network at run time: ``--init-from-hf`` takes a local model folder
and ``--data`` a local file. A user who passes a Hub name (``openai-community/gpt2``,
``tatsu-lab/alpaca``) gets, in the error, the ``huggingface_hub`` / ``datasets`` calls that turn
it into a folder and a ``.jsonl`` file, to run once where the network is (README, "Models and
data from the Hub"; docs/interop.md).
"""

from __future__ import annotations

import os
import re

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_name(arg: str) -> bool:
    """True for ``org/name`` that is not a local path (one slash, no suffix of a data file,
    nothing there on disk)."""
    return bool(_HUB_NAME.match(arg)) and not os.path.exists(arg) \
        and not arg.endswith((".jsonl", ".json", ".txt", ".parquet", ".toml"))


def model_recipe(name: str) -> str:
    """The recipe that fetches Hub model ``name`` into ``models/<name>``."""
    folder = f"models/{name.split('/')[-1]}"
    return (f"{name} looks like a Hugging Face Hub name, and shardwise reads only local "
            "folders: fetch it once where the network is, with python -c \"from huggingface_hub "
            f"import snapshot_download; snapshot_download('{name}', local_dir='{folder}')\", "
            f"then pass --init-from-hf {folder}")


def data_recipe(name: str) -> str:
    """The recipe that writes Hub dataset ``name``'s train split as ``<name>.jsonl``."""
    file = f"{name.split('/')[-1]}.jsonl"
    return (f"{name} looks like a Hugging Face Hub dataset, and shardwise reads only local "
            "files: write it once where the network is, with python -c \"from datasets import "
            f"load_dataset; load_dataset('{name}', split='train').to_json('{file}')\" (one JSON "
            f"record per line), then pass --data {file}")
