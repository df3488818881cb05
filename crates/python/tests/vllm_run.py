"""One vLLM generation on the CPU, run as a script by test_vllm.py (vLLM spawns its
engine and workers, so it needs a `__main__` of its own).

    python vllm_run.py MODEL_DIR OUT.json MODE [REPORT_DIR]

MODE: `plain` (vLLM as it is), `arfuse` (`arfuse.vllm.compilation_config(report_dir=...)`),
`broken` (the same with the fused op's CPU kernel made wrong by `broken_op.py`, which the
workers import when they unpickle its pass). Greedy, tensor parallel size 2, token-id
prompts; writes the generated tokens and the prompt logprobs (the logprob of each prompt
token under the model, as a float) of every prompt to OUT.json.
"""

import json
import os
import sys

# Prompts as token ids (the model has no tokenizer): lengths 5, 9 and 16.
PROMPTS = [
    [1, 5, 9, 33, 100],
    [2, 7, 40, 41, 42, 300, 301, 17, 88],
    [3, 11, 19, 23, 29, 31, 37, 43, 47, 53, 59, 61, 67, 71, 73, 79],
]
MAX_TOKENS = 8


def main() -> None:
    model, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    report_dir = sys.argv[4] if len(sys.argv) > 4 else None
    from vllm import LLM, SamplingParams

    if mode == "plain":
        cc = None
    elif mode == "arfuse":
        import arfuse.vllm

        cc = arfuse.vllm.compilation_config(report_dir=report_dir)
    elif mode == "broken":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import broken_op

        cc = broken_op.compilation_config(report_dir=report_dir)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    llm = LLM(
        model=model,
        tensor_parallel_size=2,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        seed=0,
        compilation_config=cc,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=0, detokenize=False)
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    data = []
    for prompt, r in zip(PROMPTS, results):
        logprobs = []
        for tok, entry in zip(prompt[1:], (r.prompt_logprobs or [])[1:]):
            logprobs.append(entry[tok].logprob)
        data.append({"tokens": list(r.outputs[0].token_ids), "prompt_logprobs": logprobs})
    with open(out, "w") as f:
        json.dump(data, f)


if __name__ == "__main__":
    main()
