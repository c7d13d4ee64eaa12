"""Write tiny but real GGUF models (llama architecture, random weights) for tests and benches.

The model is a genuine llama.cpp "llama" model: RMSNorm, RoPE attention, SwiGLU feed-forward,
and an SPM ("llama") tokenizer with byte fallback, so every string tokenizes and every token
detokenizes. Weights are random: the text it writes is gibberish, but it is *deterministic*
gibberish, which is what tests of an inference engine need.

Two choices make test output easy to reason about:
- the output rows of the special tokens and of non-printable bytes are zero, so greedy
  decoding never ends early on `</s>` and never emits broken UTF-8 (the logits of the
  other tokens are large and random, and the greedy maximum is always positive);
- the vocabulary holds printable ASCII pieces and a few merges, so generated text is
  readable ASCII and stop strings can be picked from it.

`pooling` writes `llama.pooling_type` so the same file works as an embedding model
(llama.cpp reads that key for every architecture): 1 = mean, 2 = cls, 3 = last.

`write_tiny_reranker` writes the same model as a "qwen3" architecture (per-head RMS norms
of q and k, NeoX RoPE) with a classifier head `cls.output.weight` and pooling 4 (rank): what
llama.cpp serves as a Qwen3 reranker (the last token's state through the head, a softmax
over the labels; llama-server's score is the first label's probability).

`write_tiny_lora` writes a LoRA adapter GGUF for such a model (what llama.cpp's
llama_adapter_lora_init and llama-server's `--lora` load): `general.type` "adapter",
`adapter.type` "lora", `adapter.lora.alpha`, and for each adapted weight `W` of the base a
pair `W.lora_a` (numpy (rank, n_in)) and `W.lora_b` ((n_out, rank)); llama.cpp adds
scale * alpha / rank * B @ A to W's product. `reference_logprobs(..., lora=...)` merges it.

`dtype` is f32 (the default: exact numpy references), f16, q8_0 or q4_0 (quantized with the
gguf package's reference quantizer; row lengths must be multiples of 32). `quantize_gguf`
turns a written model into a K-quant (Q4_K_M, Q6_K: what most published GGUFs are) with
llama.cpp's own quantizer, which the gguf package lacks (row lengths: multiples of 256).
`read_weights` dequantizes what it reads, so the numpy reference runs any of them.

Only the `gguf` package (the llama.cpp project's own writer) and numpy are needed
(`quantize_gguf`: llama-cpp-python too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np

# ChatML: llama.cpp's llama_chat_apply_template recognises it by the `<|im_start|>` marker.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# SentencePiece's visible space.
SPACE = "\u2581"

_MERGES = (
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te",
    SPACE + "t", SPACE + "a", SPACE + "s", SPACE + "w", SPACE + "o", SPACE + "the",
    SPACE + "and", SPACE + "of", SPACE + "to", SPACE + "in", SPACE + "is",
)


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then printable ASCII pieces and merges."""
    # Token types as in gguf.TokenType: NORMAL=1, UNKNOWN=2, CONTROL=3, BYTE=6.
    tokens = ["<unk>", "<s>", "</s>"]
    scores = [0.0, 0.0, 0.0]
    types = [2, 3, 3]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        scores.append(0.0)
        types.append(6)
    # Single characters score lowest and longer merges higher, so SPM's bigram merging
    # prefers the merges (it merges the highest-scoring pair first).
    for char in [SPACE] + [chr(c) for c in range(0x21, 0x7F)]:
        tokens.append(char)
        scores.append(-100.0)
        types.append(1)
    for rank, merge in enumerate(_MERGES):
        tokens.append(merge)
        scores.append(-float(rank))
        types.append(1)
    return tokens, scores, types


def write_tiny_llama(
    path: str | Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int | None = None,
    n_ff: int = 128,
    n_ctx: int = 256,
    seed: int = 0,
    dtype: Literal["f32", "f16", "q8_0", "q4_0"] = "f32",
    pooling: int | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
    add_eos: bool = False,
    control_tokens: tuple[str, ...] = (),
    user_tokens: tuple[str, ...] = (),
    arch: Literal["llama", "qwen3"] = "llama",
    classifier_labels: tuple[str, ...] = (),
    rerank_template: str | None = None,
) -> Path:
    """Write a random llama-architecture GGUF to `path` and return the path. `add_eos`: the
    tokenizer appends </s> to what it tokenizes with special tokens (as BERT-style embedders
    append their SEP). `control_tokens`: more control tokens (such as Mistral's
    `[TOOL_CALLS]`), last in the vocabulary, never sampled unless biased. `user_tokens`:
    user-defined tokens after them (such as Qwen 3's `<think>` and `</think>`): always
    tokenized whole, detokenized to their text, and sampled like ordinary pieces.
    `arch` "qwen3" adds the q/k norms; `classifier_labels` (qwen3) a `cls.output.weight` head
    with one row per label; `rerank_template` the GGUF's `tokenizer.chat_template.rerank`."""
    import gguf  # the writer is a dev/test dependency, not a runtime one

    quantized = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}

    path = Path(path)
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    n_head_kv = n_head if n_head_kv is None else n_head_kv
    head_dim = n_embd // n_head
    tokens, scores, types = _vocab()
    for text in control_tokens:
        tokens.append(text)
        scores.append(0.0)
        types.append(3)
    for text in user_tokens:  # gguf.TokenType.USER_DEFINED
        tokens.append(text)
        scores.append(0.0)
        types.append(4)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def matrix(name: str, value: np.ndarray) -> None:
        # numpy shape (rows, cols) = GGUF ne (cols, rows): one row per output feature.
        if dtype in quantized:
            kind = quantized[dtype]
            writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, value.astype(np.float32 if dtype == "f32" else np.float16))

    def linear(n_out: int, n_in: int) -> np.ndarray:
        return rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)

    def norm() -> np.ndarray:
        # Norm weights stay f32, as llama.cpp's converters write them.
        return np.ones(n_embd, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("edged-tiny-llama")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type({"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}[dtype])
    writer.add_vocab_size(n_vocab)
    if pooling is not None:
        writer.add_uint32(f"{arch}.pooling_type", pooling)
    if classifier_labels:
        writer.add_classifier_output_labels(list(classifier_labels))
    _add_tokenizer(writer, tokens, scores, types, add_eos=add_eos)
    templates = [{"name": "default", "template": chat_template}] if chat_template is not None else []
    if rerank_template is not None:
        templates.append({"name": "rerank", "template": rerank_template})
    if templates:
        writer.add_chat_template(templates)

    matrix("token_embd.weight", rng.standard_normal((n_vocab, n_embd)))
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", norm())
        matrix(f"{prefix}.attn_q.weight", linear(n_embd, n_embd))
        matrix(f"{prefix}.attn_k.weight", linear(n_head_kv * head_dim, n_embd))
        matrix(f"{prefix}.attn_v.weight", linear(n_head_kv * head_dim, n_embd))
        matrix(f"{prefix}.attn_output.weight", linear(n_embd, n_embd))
        if arch == "qwen3":
            writer.add_tensor(f"{prefix}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(f"{prefix}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", norm())
        matrix(f"{prefix}.ffn_gate.weight", linear(n_ff, n_embd))
        matrix(f"{prefix}.ffn_up.weight", linear(n_ff, n_embd))
        matrix(f"{prefix}.ffn_down.weight", linear(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", norm())
    output = rng.standard_normal((n_vocab, n_embd))
    matrix("output.weight", _silent_specials(output, tokens, types))
    if classifier_labels:
        # Written as f32 whatever `dtype`: a head of 2 rows is no multiple of a quant block's 32.
        writer.add_tensor("cls.output.weight", linear(len(classifier_labels), n_embd).astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: Any, tokens: list[str], scores: list[float], types: list[int], *, add_eos: bool) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(add_eos)


def _silent_specials(output: np.ndarray, tokens: list[str], types: list[int]) -> np.ndarray:
    """The output matrix with zero rows for control tokens and non-printable bytes: the
    random model then never writes them, and its text stays printable ASCII."""
    for token_id, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in (2, 3) or (kind == 6 and not 0x20 <= int(text[3:5], 16) < 0x7F):
            output[token_id] = 0.0
    return output


def write_tiny_mamba(path: str | Path, *, n_embd: int = 32, n_layer: int = 2, n_ctx: int = 256, seed: int = 0) -> Path:
    """A random Mamba GGUF (llama.cpp's `mamba` architecture) with the tiny llama's vocabulary
    and chat template: a recurrent memory, whose cached state llama.cpp cannot shift or cut
    (llama_memory_can_shift is false). For the paths that depend on that."""
    import gguf

    path = Path(path)
    tokens, scores, types = _vocab()
    rng = np.random.default_rng(seed)
    d_inner, d_state, d_conv, dt_rank = 2 * n_embd, 8, 4, 4  # llama.cpp takes an expansion of 2 only

    def f32(value: np.ndarray) -> np.ndarray:
        return np.asarray(value, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_name("edged-tiny-mamba")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)
    writer.add_vocab_size(len(tokens))
    _add_tokenizer(writer, tokens, scores, types, add_eos=False)
    writer.add_chat_template([{"name": "default", "template": CHATML_TEMPLATE}])
    writer.add_tensor("token_embd.weight", f32(rng.standard_normal((len(tokens), n_embd))))
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ssm_in.weight", f32(rng.standard_normal((2 * d_inner, n_embd)) / np.sqrt(n_embd)))
        writer.add_tensor(f"{prefix}.ssm_conv1d.weight", f32(rng.standard_normal((d_inner, d_conv)) / 2))
        writer.add_tensor(f"{prefix}.ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ssm_x.weight",
                          f32(rng.standard_normal((dt_rank + 2 * d_state, d_inner)) / np.sqrt(d_inner)))
        writer.add_tensor(f"{prefix}.ssm_dt.weight", f32(rng.standard_normal((d_inner, dt_rank)) / np.sqrt(dt_rank)))
        writer.add_tensor(f"{prefix}.ssm_dt.bias", np.zeros(d_inner, dtype=np.float32))
        # A = -exp(A_log), negative: the state decays (as a trained Mamba's).
        writer.add_tensor(f"{prefix}.ssm_a", f32(-np.tile(np.arange(1, d_state + 1), (d_inner, 1))))
        writer.add_tensor(f"{prefix}.ssm_d", np.ones(d_inner, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ssm_out.weight", f32(rng.standard_normal((n_embd, d_inner)) / np.sqrt(d_inner)))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", f32(_silent_specials(rng.standard_normal((len(tokens), n_embd)), tokens, types)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Qwen3-Reranker's layout, shortened: llama-server substitutes {query} and {document} and
# tokenizes the result with special tokens parsed, adding no BOS.
RERANK_TEMPLATE = "<s>query: {query}\ndocument: {document}\nrelevant:"


def write_tiny_reranker(path: str | Path, *, rerank_template: str | None = None, **kwargs: object) -> Path:
    """A tiny Qwen3-style reranker (see the module docstring): rank pooling, a head of two
    labels ("yes", "no"), no chat template unless `rerank_template` gives its rerank one."""
    options: dict[str, object] = {"chat_template": None, "seed": 7} | kwargs
    return write_tiny_llama(
        path, arch="qwen3", pooling=4, classifier_labels=("yes", "no"), rerank_template=rerank_template,
        **options,  # type: ignore[arg-type]
    )


def with_fim_tokens(
    source: Path, target: Path, pre: int, suf: int, mid: int, rep: int | None = None, sep: int | None = None
) -> Path:
    """A copy of a GGUF whose tokenizer names fill-in-the-middle tokens (llama.cpp's keys);
    `rep` and `sep`: the repository-level ones too (FIM_REP, FIM_SEP)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), arch="llama", endianess=reader.endianess)
    keys = gguf.Keys.Tokenizer
    metadata = {
        key: MetadataDetails(gguf.GGUFValueType.UINT32, value)
        for key, value in ((keys.FIM_PRE_ID, pre), (keys.FIM_SUF_ID, suf), (keys.FIM_MID_ID, mid),
                           (keys.FIM_REP_ID, rep), (keys.FIM_SEP_ID, sep))
        if value is not None
    }
    copy_with_new_metadata(reader, writer, metadata, [])
    return target


# The base weights a test adapter changes by default: every matrix of every block.
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_tiny_lora(
    path: str | Path,
    base: str | Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 1,
    targets: tuple[str, ...] = LORA_TARGETS,
    magnitude: float = 1.0,
    arch: str | None = None,
    general_type: str = "adapter",
    adapter_type: str = "lora",
    task_name: str | None = None,
    prompt_prefix: str | None = None,
    alora_invocation_tokens: tuple[int, ...] = (),
    extra_tensor: tuple[str, tuple[int, int]] | None = None,
) -> Path:
    """Write a random LoRA adapter GGUF for the model at `base` (its shapes read from it) to
    `path`: for each block's weight named in `targets` (and "output" for the output matrix),
    A (rank, n_in) and B (n_out, rank), random, B scaled by `magnitude` (a trained adapter's
    B starts at zero; a random one makes the difference visible). `arch` (default the
    base's), `general_type` and `adapter_type` write other values, for the load errors;
    `task_name`, `prompt_prefix` and `alora_invocation_tokens` llama.cpp's optional keys;
    `extra_tensor` (name, numpy shape) one more pair of that name, for a wrong base."""
    import gguf

    reader = gguf.GGUFReader(str(base))
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # numpy (rows, cols)
    base_arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch or base_arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    if task_name is not None:
        writer.add_string(gguf.Keys.Adapter.LORA_TASK_NAME, task_name)
    if prompt_prefix is not None:
        writer.add_string(gguf.Keys.Adapter.LORA_PROMPT_PREFIX, prompt_prefix)
    if alora_invocation_tokens:
        writer.add_key_value(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS, list(alora_invocation_tokens),
                             gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
    names = [name for name in shapes if name.startswith("blk.") and name.split(".")[2] in targets]
    if "output" in targets:
        names.append("output.weight")
    pairs = [(name, shapes[name]) for name in names]
    if extra_tensor is not None:
        pairs.append(extra_tensor)
    for name, (n_out, n_in) in pairs:
        writer.add_tensor(f"{name}.lora_a", (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", (magnitude * rng.standard_normal((n_out, rank)) / np.sqrt(rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def merged_weights(base: Path, adapters: tuple[tuple[Path, float], ...] = ()) -> dict[str, np.ndarray]:
    """The base's weights with each (adapter, scale) merged as llama.cpp applies it:
    W + scale * alpha / rank * B @ A (scale alone when the adapter's alpha is 0)."""
    import gguf

    weights = read_weights(base)
    for path, scale in adapters:
        reader = gguf.GGUFReader(str(path))
        alpha = float(reader.fields[gguf.Keys.Adapter.LORA_ALPHA].parts[-1][0])
        tensors = {t.name: np.array(t.data, dtype=np.float64) for t in reader.tensors}
        for name in tensors:
            if name.endswith(".lora_a"):
                target = name.removesuffix(".lora_a")
                a, b = tensors[name], tensors[target + ".lora_b"]
                factor = scale * alpha / b.shape[1] if alpha else scale
                weights[target] = weights[target] + factor * (b @ a)
    return weights


# --------------------------------------------------------------------------- numpy reference


def read_weights(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as float64, quantized ones dequantized by the gguf package (numpy code
    of its own, not llama.cpp's)."""
    import gguf

    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    reader = gguf.GGUFReader(str(path))
    return {
        t.name: np.asarray(
            t.data if t.tensor_type in plain else gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64
        )
        for t in reader.tensors
    }


# llama.cpp's file types (llama_ftype) for the K-quants `quantize_gguf` writes.
K_QUANTS = {"q4_k_m": 15, "q6_k": 18}


_QUANTIZE = """
import sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def quantize_gguf(source: Path, path: Path, kind: Literal["q4_k_m", "q6_k"]) -> Path:
    """Quantize the f32/f16 GGUF `source` to `path` as llama.cpp's `llama-quantize` does
    (llama_model_quantize: Q4_K_M keeps some tensors in Q6_K, as in published files). Each
    row length must be a multiple of 256, or llama.cpp falls back to another type for it.
    In a child process: llama.cpp logs every tensor to stderr, and the caller's process keeps
    its own log callback."""
    import subprocess
    import sys

    command = [sys.executable, "-c", _QUANTIZE, str(source), str(path), str(K_QUANTS[kind])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"llama_model_quantize failed to write {kind} from {source}: {done.stderr[-2000:]}")
    return path


def tensor_types(path: Path) -> set[str]:
    """The GGML types of a GGUF's tensors ("F32", "Q4_K", ...)."""
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def reference_forward(w: dict[str, np.ndarray], tokens: list[int], n_head: int = 4) -> np.ndarray:
    """Hidden states after the final norm, (n_tokens, n_embd): llama with RoPE on adjacent pairs;
    qwen3 (weights with q/k norms) with per-head RMS norms of q and k and NeoX RoPE (halves)."""
    x = w["token_embd.weight"][tokens]
    n, d = x.shape
    hd = d // n_head
    n_layer = sum(1 for name in w if name.endswith(".attn_q.weight"))

    def rms(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-5) * g

    angle = np.arange(n)[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

    qwen3 = "blk.0.attn_q_norm.weight" in w

    def rope(m: np.ndarray) -> np.ndarray:
        out = np.empty_like(m)
        if qwen3:
            a, b = m[..., : hd // 2], m[..., hd // 2 :]
            out[..., : hd // 2] = a * cos - b * sin
            out[..., hd // 2 :] = a * sin + b * cos
            return out
        out[..., 0::2] = m[..., 0::2] * cos - m[..., 1::2] * sin
        out[..., 1::2] = m[..., 0::2] * sin + m[..., 1::2] * cos
        return out

    causal = np.triu(np.full((n, n), -np.inf), 1)
    for layer in range(n_layer):
        p = f"blk.{layer}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(n, n_head, hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(n, n_head, hd)
        if qwen3:
            q, k = rms(q, w[p + "attn_q_norm.weight"]), rms(k, w[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, n_head, hd)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(n, d) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"])


def reference_greedy(w: dict[str, np.ndarray], prompt: list[int], steps: int = 8) -> list[int]:
    """`steps` greedy tokens after `prompt` by reference_forward."""
    tokens = list(prompt)
    for _ in range(steps):
        logits = reference_forward(w, tokens)[-1] @ w["output.weight"].T
        top2 = np.sort(logits)[-2:]
        # llama.cpp keeps K/V in f16, so its logits differ from ours by ~1e-2: a near tie
        # would make this comparison meaningless, and the fixed seed must not produce one.
        assert top2[1] - top2[0] > 0.1, "reference has a near tie; pick another seed"
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt) :]


def llama_cpp_python_greedy(path: Path, prompts: list[list[int]], steps: int,
                            lora: tuple[Path, float] | None = None) -> list[list[int]]:
    """What llama-cpp-python's own high-level API generates greedily, `steps` tokens of each
    prompt, its state reset for each (the same llama.cpp, set up by other code than edged's),
    with the LoRA adapter `lora` (path, scale) where given."""
    from llama_cpp import Llama

    kwargs: dict[str, Any] = {} if lora is None else {"lora_path": str(lora[0]), "lora_scale": lora[1]}
    llm = Llama(str(path), n_ctx=256, n_threads=1, verbose=False, **kwargs)
    try:
        out = []
        for prompt in prompts:
            ids: list[int] = []
            for token in llm.generate(prompt, temp=0.0, reset=True):
                ids.append(token)
                if len(ids) == steps:
                    break
            out.append(ids)
        return out
    finally:
        llm.close()


def reference_logprobs(path: Path, tokens: list[int], lora: tuple[tuple[Path, float], ...] = ()) -> np.ndarray:
    """(n_tokens, n_vocab): log-softmax of the logits after each token, as numpy computes them
    (with the LoRA adapters `lora`, (path, scale) each, merged into the weights)."""
    weights = merged_weights(path, lora)
    logits = reference_forward(weights, tokens) @ weights["output.weight"].T
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_rerank_score(path: Path, tokens: list[int]) -> float:
    """What llama.cpp's rank pooling gives a Qwen3 reranker for one prompt, as numpy computes
    it: the last token's state through `cls.output.weight`, softmax, the first label."""
    weights = read_weights(path)
    logits = weights["cls.output.weight"] @ reference_forward(weights, tokens)[-1]
    probs = np.exp(logits - logits.max())
    return float(probs[0] / probs.sum())
