"""Names, not paths: what the world sees of a model is its catalog name, hub id or own name, never the local path;
and a mistyped name is one line at once, with the closest catalog names, the hub asked only when it can answer."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarmlm.model.catalog import catalog_name_of, gguf_path
from swarmlm.model.source import ModelNotFound, resolve, served_name


def test_served_names_are_names(tiny_llama, tmp_path):
    assert served_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_name(tiny_llama) == Path(tiny_llama).name
    assert served_name(tiny_llama + "/") == Path(tiny_llama).name
    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert served_name(str(gguf)) == "SmolLM2.Q4_1"
    catalog_file = gguf_path("smollm2-135m-instruct", tmp_path)  # what `swarmlm demo` hands the gateway
    catalog_file.parent.mkdir(parents=True)
    catalog_file.write_bytes(b"GGUF")
    assert catalog_name_of(catalog_file, tmp_path) == "smollm2-135m-instruct"
    assert catalog_name_of(gguf, tmp_path) is None


def test_the_tokenizer_loads_by_every_name_the_model_takes(tiny_llama):
    from transformers import AutoTokenizer as TransformersTokenizer

    from swarmlm import AutoTokenizer

    ours, theirs = AutoTokenizer.from_pretrained(tiny_llama), TransformersTokenizer.from_pretrained(tiny_llama)
    assert ours("Hello world").input_ids == theirs("Hello world").input_ids
    with pytest.raises(ModelNotFound, match="did you mean smollm2-135m-instruct"):
        AutoTokenizer.from_pretrained("smollm2-135m-instruc")


def test_a_typo_is_answered_with_the_closest_catalog_name():
    for typo in ("smollm2-135m-instruc", "smolm2-135m-instruct", "SmolLM2-135M-Instruct"):
        with pytest.raises(ModelNotFound, match="did you mean smollm2-135m-instruct"):
            resolve(typo)


@pytest.mark.parametrize("verb", ["generate", "chat", "server"])
def test_an_unknown_name_offline_fails_at_once_in_one_line(verb):
    extra = {"generate": ["--prompt", "hi"], "chat": [], "server": ["--blocks", "0:1"]}[verb]
    for name, message in (("smollm2-135m-instruc", "did you mean smollm2-135m-instruct?"),
                          ("org/not-there", "not in the local HF cache")):
        done = subprocess.run([sys.executable, "-m", "swarmlm.cli.main", verb, "--model", name, *extra],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert done.stderr.startswith(f"swarmlm {verb}: error: {name}") and message in done.stderr, done.stderr
