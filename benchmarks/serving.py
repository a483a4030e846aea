"""Serving benchmark: any OpenAI endpoint under a fixed streaming workload, side by side.

    .venv/bin/python benchmarks/serving.py                      # start and measure all peers
    .venv/bin/python benchmarks/serving.py --url http://127.0.0.1:8000 --model NAME

Workload: streaming /v1/completions, 128-token prompts (distinct held-out text per request,
so no server can answer from a prompt cache), exactly 64 output tokens (EOS ignored),
at concurrency 1, 8 and 16. Reported per level: output tok/s, TTFT p50/p99, ITL p50/p99.

Started by this script (each alone on the machine while it is measured):
- `modelship serve` on each of the demo model's `--variants` (default gptq) found in the
  storage, once per `--engine-cores` value (default auto);
- llama.cpp's `llama-server` on the same GGUF, if a binary is found (`--llama-server`, or
  `~/.cache/modelship-peers/llama-server`; build it offline as ../shared/PEERS.md says);
- `transformers serve` with `--with-transformers` (slow: minutes per level).
Prints a table and writes JSON (default benchmarks/results/serving.json).

guidellm measures modelship the same way:
    guidellm run --backend '{"kind":"openai_http","target":"http://127.0.0.1:8101",
      "model":"smollm2","request_format":"/v1/completions"}'
      --tokenizer kind=hf_auto,model=modelship-data/models/smollm2-135m-instruct/base
      --data kind=synthetic_text,prompt_tokens=128,output_tokens=64
      --profile kind=concurrent,streams=8 --constraint kind=max_requests,count=32
      --seed kind=static,value=101 --output kind=json,path=out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from modelship.loadgen import make_prompts, run_level
from modelship.pipeline.acquire import DEMO_SLUG, acquire, demo_gguf_path
from modelship.storage import Storage

PEERS_DIR = Path.home() / ".cache" / "modelship-peers"


def start_server(command: list[str], url: str, timeout_s: float = 300) -> subprocess.Popen:
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{url.rsplit(':', 1)[1]}.log", "w")  # noqa: SIM115
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited early; see {log.name}")
        for path in ("/ready", "/health"):
            try:
                if httpx.get(url + path, timeout=1).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"{command[0]} not ready after {timeout_s}s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def measure(name, url, model, prompts, levels, max_tokens) -> list[dict]:
    rows = []
    for level in levels:
        count = max(8, 2 * level)
        result = asyncio.run(run_level(url, model, prompts[:count], level, max_tokens))
        row = {"system": name, **result.to_dict()}
        print(
            f"{name:<26}{level:>4}{row['output_tok_s']:>10.1f}{row['ttft_p50_ms']:>10.0f}"
            f"{row['ttft_p99_ms']:>10.0f}{row['itl_p50_ms']:>9.1f}{row['itl_p99_ms']:>9.1f}",
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="measure this endpoint only (nothing is started)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--storage", default="./modelship-data")
    parser.add_argument("--levels", default="1,8,16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--variants", default="gptq", help="the demo's variants to serve")
    parser.add_argument(
        "--engine-cores", default="auto", help="serve --engine-core values, each its own row"
    )
    parser.add_argument("--llama-server", type=Path, default=PEERS_DIR / "llama-server")
    parser.add_argument("--with-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=101)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.json"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    storage = Storage(args.storage)
    base = acquire("demo", storage).path
    tokenizer = AutoTokenizer.from_pretrained(base)
    levels = [int(x) for x in args.levels.split(",")]
    prompts = make_prompts(tokenizer, 2 * max(levels) + 8, args.prompt_tokens, args.seed)
    print(f"{'system':<26}{'conc':>4}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}")  # fmt: skip
    rows: list[dict] = []
    if args.url:
        rows += measure(args.url, args.url, args.model, prompts, levels, args.output_tokens)
    else:
        peers = []
        for variant in args.variants.split(","):
            variant_dir = storage.variant_dir(DEMO_SLUG, variant)
            if not variant_dir.is_dir():
                print(f"(no {variant} variant at {variant_dir}: skipped)")
                continue
            for core in args.engine_cores.split(","):
                peers.append(
                    (
                        f"modelship ({variant}, {core})",
                        "http://127.0.0.1:8101",
                        [sys.executable, "-m", "modelship", "serve", str(variant_dir), "--port",
                         "8101", "--served-model-name", args.model, "--variant", variant,
                         "--engine-core", core],
                        args.model,
                    )
                )  # fmt: skip
        if args.llama_server.is_file():
            peers.append(
                (
                    "llama-server (Q4_1)",
                    "http://127.0.0.1:8103",
                    [str(args.llama_server), "-m", str(demo_gguf_path()), "--host", "127.0.0.1",
                     "--port", "8103", "-c", "4096", "-np", "16", "-t", "2", "--threads-http",
                     "32", "--alias",
                     args.model, "--no-webui", "--metrics", "--cache-ram", "0"],
                    args.model,
                )
            )  # fmt: skip
        else:
            print(f"(no llama-server at {args.llama_server}: skipped)")
        if args.with_transformers:
            (Path.home() / ".cache" / "huggingface" / "hub").mkdir(parents=True, exist_ok=True)
            peers.append(
                (
                    "transformers serve (cb)",
                    "http://127.0.0.1:8102",
                    ["transformers", "serve", str(base), "--host", "127.0.0.1", "--port",
                     "8102", "--device", "cpu", "--continuous-batching"],
                    str(base),
                )
            )  # fmt: skip
        for name, url, command, model in peers:
            process = start_server(command, url)
            try:
                rows += measure(name, url, model, prompts, levels, args.output_tokens)
            finally:
                stop_server(process)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
