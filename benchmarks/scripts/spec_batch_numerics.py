"""Does batch shape alone move bf16 greedy tokens where speculation does? For each prompt of the
speculative bench: plain decoding alone (1 row a step), plain decoding beside 4 copies of itself
(5 rows a step, the rows of a k = 4 verify step), and n-gram speculation; the common prefix of
each with plain-alone. Usage (GPU): python benchmarks/scripts/spec_batch_numerics.py MODEL.gguf OUT.json"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvos import LLM, SamplingParams
from kvos.bench.machine import machine_info
from kvos.bench.speculative import common_prefix


def main(model: str, out: str) -> None:
    prompts = json.loads(Path("benchmarks/results/speculative-cpu.json").read_text())["prompt_ids"]
    kw = dict(model=model, device="cuda", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 30)
    plain = LLM(**kw)
    spec = LLM(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=128)
    rows = []
    for workload in ("quote", "multi_turn", "code_edit"):
        for ids in prompts[workload]:
            p = {"prompt_token_ids": ids}
            alone = list(plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
            five = list(plain.generate([p] * 5, params, use_tqdm=False)[0].outputs[0].token_ids)
            sp = list(spec.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
            rows.append({"workload": workload, "plain_batch5_common": common_prefix(five, alone),
                         "spec_common": common_prefix(sp, alone), "tokens": len(alone)})
            print(json.dumps(rows[-1]), flush=True)
    Path(out).write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
