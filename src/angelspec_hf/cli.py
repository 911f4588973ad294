"""The ``angelspec-hf`` command line.

``angelspec-hf demo`` (the README's main job until the benchmark lands) generates on the reference
target with and without each drafter, checks that greedy outputs are identical, and reports tokens
per target forward (tau) and tokens/s, interleaved per prompt, as a table and a JSON report.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModel, PreTrainedModel

from . import DFlyDrafter, MTPDrafter
from .reference import REFERENCE_TARGET_ID, load_reference_target

logger = logging.getLogger("angelspec_hf")

# Short prompts of our own, one chat and one code and one math each way; `--prompts` takes others.
DEMO_PROMPTS = (
    ("chat", "Give me three tips for staying focused while working from home."),
    ("chat", "What is the difference between weather and climate?"),
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("code", "Write a Python function is_palindrome(s) that ignores case and spaces."),
    ("math", "A shop sells pens at 3 dollars each. Tom buys 7 pens and pays with a 50 dollar bill. How much change does he get?"),
    ("math", "What is 15% of 240? Explain step by step."),
)


@dataclass
class DemoRow:
    domain: str
    prompt: str
    drafter: str
    new_tokens: int
    identical: bool
    tau: float
    plain_tokens_per_s: float
    speculative_tokens_per_s: float

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0


def shipped_drafter_dirs(root: Path) -> list[Path]:
    """Drafter directories under ``modeling/`` that were trained for the reference target."""
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir() if (path / "config.json").exists() and (path / "model.safetensors").exists())


def demo_drafters(target: PreTrainedModel, modeling_dir: Path) -> dict[str, PreTrainedModel]:
    drafters = {path.name: AutoModel.from_pretrained(path).eval() for path in shipped_drafter_dirs(modeling_dir)}
    if not drafters:
        logger.warning("No trained drafters under %s: using untrained ones, so expect tau near 1.", modeling_dir)
        torch.manual_seed(0)
        drafters = {
            "MTP (untrained)": MTPDrafter.from_target(target, num_draft_tokens=3).eval(),
            "DFly-Block8 (untrained)": DFlyDrafter.from_target(target, block_size=8).eval(),
        }
    return drafters


def read_prompts(path: str | None) -> list[tuple[str, str]]:
    if path is None:
        return list(DEMO_PROMPTS)
    prompts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            prompts.append((record.get("domain", Path(path).stem), record["prompt"]))
    return prompts


def timed_generate(target, inputs, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(**inputs, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def run_demo(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_reference_target()
    drafters = demo_drafters(target, Path(args.modeling_dir))
    rows: list[DemoRow] = []
    for domain, prompt in read_prompts(args.prompts):
        messages = [{"role": "user", "content": prompt}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        timed_generate(target, inputs, max_new_tokens=4)  # warm-up
        for name, drafter in drafters.items():
            # Interleaved: the plain run is repeated beside each drafter so drifts hit both alike.
            plain, plain_s = timed_generate(target, inputs, max_new_tokens=args.max_new_tokens)
            fast, fast_s = timed_generate(target, inputs, max_new_tokens=args.max_new_tokens, assistant_model=drafter)
            new_tokens = fast.shape[1] - inputs["input_ids"].shape[1]
            rows.append(DemoRow(
                domain=domain, prompt=prompt, drafter=name, new_tokens=new_tokens,
                identical=torch.equal(plain, fast), tau=drafter.last_speculation_stats.tau,
                plain_tokens_per_s=(plain.shape[1] - inputs["input_ids"].shape[1]) / plain_s,
                speculative_tokens_per_s=new_tokens / fast_s,
            ))
            logger.info("%s | %s | identical=%s tau=%.2f", domain, name, rows[-1].identical, rows[-1].tau)
    print_table(rows)
    write_report(rows, Path(args.report))
    return 0 if all(row.identical for row in rows) else 1


def print_table(rows: list[DemoRow]) -> None:
    header = f"{'domain':6} {'drafter':28} {'identical':>9} {'tau':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.domain:6} {row.drafter:28} {str(row.identical):>9} {row.tau:5.2f} "
              f"{row.plain_tokens_per_s:11.1f} {row.speculative_tokens_per_s:10.1f} {row.speedup:6.2f}x")
    identical = sum(row.identical for row in rows)
    print(f"\ngreedy identity: {identical}/{len(rows)} runs token-identical to plain target.generate")


def write_report(rows: list[DemoRow], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "target": REFERENCE_TARGET_ID,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "rows": [{**asdict(row), "speedup": row.speedup} for row in rows],
    }
    path.write_text(json.dumps(report, indent=2))
    print(f"report written to {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="angelspec-hf", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="greedy identity and tau of the drafters on the reference target")
    demo.add_argument("--prompts", help="JSONL file with a 'prompt' (and optional 'domain') per line")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--modeling-dir", default="modeling", help="directory of shipped drafters")
    demo.add_argument("--report", default="reports/demo.json")
    demo.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    demo.set_defaults(handler=run_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
