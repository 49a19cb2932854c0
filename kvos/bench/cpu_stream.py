"""``kvos bench cpu``: one stream on the CPU, in one run: kvos (its C kernels), kvos on float32
weights only (``block_weights=False``), transformers ``generate`` (float32) and llama.cpp
(``llama-cpp-python``, when installed) on the same GGUF, the same prompt token ids, greedy, for
each thread count. Reports time to first token, decode tok/s (tokens after the first over the
time after it), end-to-end tok/s, and how many leading tokens each engine shares with
transformers. ``kvos-int8`` / ``kvos-fp8`` (not run unless named in ``--engines``) are kvos with
an 8-bit KV cache. Rounds alternate engines; the best round of each is kept."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DATA = Path(__file__).parent / "data"
ENGINES = ("kvos", "kvos-float32", "transformers", "llama.cpp")
KV8_ENGINES = {"kvos-int8": "int8", "kvos-fp8": "fp8_e4m3"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (a passage of the bundled text)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=[*ENGINES, *KV8_ENGINES])
    p.add_argument("--output", default="benchmarks/results/cpu-stream.json")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class KvosStream:
    def __init__(self, model: str | None, block_weights: bool, max_len: int, kv_cache_dtype: str = "auto") -> None:
        from kvos import LLM

        self.llm = LLM(model, device="cpu", block_weights=block_weights, max_model_len=max_len,
                       kv_cache_memory_bytes=256 << 20, kv_cache_dtype=kv_cache_dtype)

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        from kvos import SamplingParams

        timings = []
        for max_tokens in (1, n):
            self.llm.reset_prefix_cache()
            t0 = time.perf_counter()
            out = self.llm.generate([{"prompt_token_ids": prompt}],
                                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                    use_tqdm=False)[0]
            timings.append(time.perf_counter() - t0)
        return timings[0], timings[1], list(out.outputs[0].token_ids)


class TransformersStream:
    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        import torch

        ids = torch.tensor([prompt])
        timings = []
        for new in (1, n):
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                          min_new_tokens=new, do_sample=False, pad_token_id=0)
            timings.append(time.perf_counter() - t0)
        return timings[0], timings[1], out[0, len(prompt):].tolist()


class LlamaCppStream:
    """llama.cpp through llama-cpp-python: the prompt in one ``eval``, then one token per
    ``eval``, each chosen by argmax of the last logits."""

    def __init__(self, path: Path, max_len: int) -> None:
        import llama_cpp  # noqa: F401  (ImportError when llama-cpp-python is not installed)

        self.path, self.max_len, self.threads, self.model = path, max_len, None, None

    def _load(self, threads: int):
        from llama_cpp import Llama

        if self.threads != threads:
            self.model = Llama(model_path=str(self.path), n_ctx=self.max_len, n_batch=512, n_threads=threads,
                               n_threads_batch=threads, verbose=False)
            self.threads = threads
        return self.model

    def run(self, prompt: list[int], n: int, threads: int) -> tuple[float, float, list[int]]:
        import llama_cpp
        import numpy as np

        m = self._load(threads)

        def argmax() -> int:
            logits = llama_cpp.llama_get_logits_ith(m._ctx.ctx, -1)
            return int(np.ctypeslib.as_array(logits, shape=(m.n_vocab(),)).argmax())

        m.reset()
        t0 = time.perf_counter()
        m.eval(prompt)
        out = [argmax()]
        ttft = time.perf_counter() - t0
        while len(out) < n:
            m.eval([out[-1]])
            out.append(argmax())
        return ttft, time.perf_counter() - t0, out


def run(a: argparse.Namespace) -> dict:
    import torch

    from kvos.bench.machine import machine_info
    from kvos.models.loader import load_tokenizer, resolve_model_path

    path = resolve_model_path(a.model)
    if path.is_dir() or path.suffix != ".gguf":
        raise SystemExit("kvos bench cpu: --model must be a GGUF file (llama.cpp and the block kernels read GGUF)")
    text = (DATA / "macbeth_act1_scene5-act2.txt").read_text()
    prompt = load_tokenizer(path)(text, add_special_tokens=False)["input_ids"][: a.prompt_len]
    max_len = a.prompt_len + a.output_len + 16
    engines: dict = {}
    for name in a.engines:
        if name == "kvos":
            engines[name] = KvosStream(a.model, True, max_len)
        elif name == "kvos-float32":
            engines[name] = KvosStream(a.model, False, max_len)
        elif name in KV8_ENGINES:
            engines[name] = KvosStream(a.model, True, max_len, KV8_ENGINES[name])
        elif name == "transformers":
            engines[name] = TransformersStream(path)
        else:
            try:
                engines[name] = LlamaCppStream(path, max_len)
            except ImportError:
                print("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python); skipped")
    rows: dict = {}
    for threads in a.threads:
        torch.set_num_threads(threads)
        for rnd in range(a.rounds):
            for name, engine in engines.items():
                args = (prompt, a.output_len) + ((threads,) if name == "llama.cpp" else ())
                ttft, total, tokens = engine.run(*args)
                decode_tok_s = (len(tokens) - 1) / (total - ttft) if total > ttft else 0.0
                row = {"engine": name, "threads": threads, "ttft_s": round(ttft, 4), "total_s": round(total, 4),
                       "decode_tok_s": round(decode_tok_s, 2), "e2e_tok_s": round(len(tokens) / total, 2),
                       "tokens": tokens}
                best = rows.get((name, threads))
                if best is None or row["e2e_tok_s"] > best["e2e_tok_s"]:
                    rows[(name, threads)] = row
                print(f"threads {threads} round {rnd} {name}: ttft {ttft:.3f} s, decode {decode_tok_s:.1f} tok/s")
    for (name, threads), row in rows.items():
        ref = rows.get(("transformers", threads))
        row["same_tokens_as_transformers"] = None if ref is None else common_prefix(row["tokens"], ref["tokens"])
    result = {"machine": machine_info(), "model": str(path), "prompt_tokens": len(prompt),
              "output_tokens": a.output_len, "rounds": a.rounds,
              "rows": [dict(r, tokens=r["tokens"][:16]) for r in rows.values()]}
    for threads in a.threads:
        kv, lc = rows.get(("kvos", threads)), rows.get(("llama.cpp", threads))
        if kv and lc:
            result.setdefault("kvos_over_llama_cpp_decode", {})[str(threads)] = round(
                kv["decode_tok_s"] / lc["decode_tok_s"], 3)
    result["summary"] = {f"{r['engine']} ({r['threads']} thr)": f"decode {r['decode_tok_s']} tok/s, ttft {r['ttft_s']} s"
                         for r in rows.values()}
    result["summary"]["machine"] = f"{result['machine']['cpu']} ({result['machine']['cores']} cores)"
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return result
