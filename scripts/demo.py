"""A short generation demo on the embedded default model (SmolLM2-135M-Instruct)."""

import argparse
import time

from tokenspeed_jax import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF dir, .gguf file or orbax dir")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(args.model)
    print(f"loaded {llm.model_path.name} in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    (out,) = llm.chat([{"role": "user", "content": args.prompt}],
                      SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    elapsed = time.perf_counter() - start
    print(f"user: {args.prompt}\nassistant: {out.text}")
    print(f"{len(out.token_ids)} tokens in {elapsed:.2f} s (compile included)")


if __name__ == "__main__":
    main()
