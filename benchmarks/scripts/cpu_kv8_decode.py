"""One CPU stream's decode speed with each KV cache dtype (float32, int8, fp8): the default model,
a 256-token prompt, 128 greedy tokens, 1 and 2 threads, best of 2. Prints one JSON line naming
the kvos tree it ran (run it with ``PYTHONPATH=<a checkout>`` to compare two versions).

    python benchmarks/scripts/cpu_kv8_decode.py
"""
import json
import time
from pathlib import Path

import torch

import kvos
from kvos import LLM, SamplingParams

res = {"tree": kvos.__file__}
text = (Path(kvos.__file__).parent / "bench/data/macbeth_act1_scene5-act2.txt").read_text()
for dt in ("auto", "int8", "fp8_e4m3"):
    llm = LLM(kv_cache_dtype=dt, kv_cache_memory_bytes=256 << 20)
    ids = llm.get_tokenizer().encode(text)[:256]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        best = 0.0
        for _ in range(2):
            times = []
            for n in (1, 128):
                llm.reset_prefix_cache()
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                             use_tqdm=False)
                times.append(time.perf_counter() - t)
            best = max(best, 127 / (times[1] - times[0]))
        res[f"{dt}_{threads}t_decode_tok_s"] = round(best, 1)
    del llm
print(json.dumps(res))
