"""angelspec-hf Space: plain vs speculative generation on SmolLM2-135M-Instruct, side by side.

Runs locally with `make demo` (or `python spaces/app.py`) on the reference target and the drafters
shipped under modeling/ (ANGELSPEC_HF_MODELING points elsewhere). Offline by design: analytics
are off and nothing is fetched except the reference target's wheel on first use. One generation
runs at a time; other users queue (the target and drafters are shared objects).

Scripted use: the `/compare` endpoint takes (prompt, drafter, dcut, max_new_tokens) and returns
plain and speculative text, whether they are identical, tau, tokens/s and speedup, e.g.
    from gradio_client import Client
    Client("http://127.0.0.1:7860/").predict("Write a Python function...", "DFly-Block8", False, 64, api_name="/compare")
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402

ROUTER = "router (all drafters, online)"
DOMAIN_EXAMPLES = {"chat": "mtbench", "code": "humaneval", "math": "gsm8k"}
HERE = Path(__file__).resolve().parent


def load_models():
    """The reference target and every drafter shipped under modeling/ (short names)."""
    import torch
    from transformers import AutoModel

    from angelspec_hf.cli import shipped_drafter_dirs
    from angelspec_hf.reference import load_reference_target

    target, tokenizer = load_reference_target()
    root = Path(os.environ.get("ANGELSPEC_HF_MODELING", HERE.parent / "modeling"))
    drafters = {path.name.split("-AngelSpec-")[-1]: AutoModel.from_pretrained(path, dtype=torch.float32).eval()
                for path in shipped_drafter_dirs(root)}
    return target, tokenizer, drafters


def example_prompt(domain: str) -> str:
    from angelspec_hf.prompts import load_prompts

    return load_prompts(DOMAIN_EXAMPLES[domain], "eval")[0]


def build_demo(target, tokenizer, drafters: dict, cost_model=None) -> gr.Blocks:
    """The Space's UI over the given models (tests pass tiny ones)."""
    from angelspec_hf.demo import RunView, compare, engine_view, generate_view, segments
    from angelspec_hf.evaluation import chat_inputs
    from angelspec_hf.generation import DCutPolicy

    choices = list(drafters) + ([ROUTER] if len(drafters) > 1 else [])

    def policy_for(dcut: bool):
        if not dcut:
            return None
        if cost_model is None:
            raise gr.Error("D-cut needs the target's cost profile; run `angelspec-hf profile` first.")
        return DCutPolicy(cost_model)

    def stats_markdown(plain: RunView, speculative: RunView | None, identical: bool | None) -> str:
        lines = [f"**plain**: {plain.tokens_per_s:.1f} tokens/s ({len(plain.token_ids)} tokens)"]
        if speculative is not None and speculative.token_ids:
            tau = f"{speculative.tau:.2f}" if speculative.tau is not None else "-"
            speedup = speculative.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
            lines.append(f"**speculative**: {speculative.tokens_per_s:.1f} tokens/s, tau {tau}, speedup {speedup:.2f}x")
        if identical is not None:
            lines.append("**identical to plain decoding**: " + ("yes" if identical else "NO"))
        return "  \n".join(lines)

    def rounds_frame(view: RunView | None, label: str = "speculative") -> pd.DataFrame:
        accepted = view.accepted_per_round[1:] if view is not None else []
        return pd.DataFrame({"round": list(range(1, len(accepted) + 1)), "accepted": accepted, "run": [label] * len(accepted)})

    def run(prompt: str, drafter_name: str, dcut: bool, max_new_tokens: int):
        if not prompt.strip():
            raise gr.Error("Type a prompt or pick a domain first.")
        if drafter_name not in choices:
            raise gr.Error(f"Unknown drafter {drafter_name!r}; choose one of {choices}.")
        inputs = chat_inputs(tokenizer, prompt)
        plain = RunView()
        for plain in generate_view(target, inputs, int(max_new_tokens)):
            yield segments(tokenizer, plain), [], stats_markdown(plain, None, None), rounds_frame(None)
        if drafter_name == ROUTER:
            views = engine_view(target, inputs, int(max_new_tokens), drafters, tokenizer.eos_token_id)
        else:
            views = generate_view(target, inputs, int(max_new_tokens), drafters[drafter_name], policy_for(dcut))
        speculative = RunView()
        for speculative in views:
            yield (segments(tokenizer, plain), segments(tokenizer, speculative),
                   stats_markdown(plain, speculative, None), rounds_frame(speculative))
        identical = plain.token_ids == speculative.token_ids
        yield (segments(tokenizer, plain), segments(tokenizer, speculative),
               stats_markdown(plain, speculative, identical), rounds_frame(speculative))

    def compare_api(prompt: str, drafter_name: str, dcut: bool, max_new_tokens: int) -> dict:
        if drafter_name not in drafters:
            raise gr.Error(f"Unknown drafter {drafter_name!r}; choose one of {list(drafters)}.")
        return compare(target, tokenizer, prompt, drafters[drafter_name], int(max_new_tokens), policy_for(dcut)).as_dict()

    def chat_vs_code(drafter_name: str, max_new_tokens: int):
        if drafter_name not in drafters:
            raise gr.Error("Pick one drafter (not the router) for the chat-vs-code view.")
        rows, frames = [], []
        for domain in ("chat", "code"):
            result = compare(target, tokenizer, example_prompt(domain), drafters[drafter_name], int(max_new_tokens))
            rows.append([domain, round(result.tau or 1.0, 2), round(result.speedup, 2), "yes" if result.identical else "NO"])
            accepted = result.accepted_per_round[1:]
            frames.append(pd.DataFrame({"round": range(1, len(accepted) + 1), "accepted": accepted, "run": domain}))
        return pd.DataFrame(rows, columns=["domain", "tau", "speedup", "identical"]), pd.concat(frames, ignore_index=True)

    with gr.Blocks(title="angelspec-hf: speculative decoding, lossless") as demo:
        gr.Markdown("# angelspec-hf\nPlain vs speculative greedy decoding of SmolLM2-135M-Instruct on this machine. "
                    "Highlighted: draft tokens the target accepted. Outputs must be identical.")
        with gr.Tab("Side by side"):
            with gr.Row():
                domain = gr.Radio(list(DOMAIN_EXAMPLES), label="domain (fills a held-out prompt)")
                drafter = gr.Dropdown(choices, value=choices[0] if choices else None, label="drafter")
                dcut = gr.Checkbox(False, label="D-cut")
                max_new_tokens = gr.Slider(8, 256, value=96, step=8, label="max new tokens")
            prompt = gr.Textbox(label="prompt", lines=3)
            go = gr.Button("Generate", variant="primary")
            with gr.Row():
                plain_out = gr.HighlightedText(label="plain generation")
                spec_out = gr.HighlightedText(label="speculative generation", color_map={"accepted draft": "green"})
            stats = gr.Markdown()
            chart = gr.BarPlot(x="round", y="accepted", color="run", label="accepted draft tokens per round")
            domain.change(example_prompt, domain, prompt, api_name=False)
            go.click(run, [prompt, drafter, dcut, max_new_tokens], [plain_out, spec_out, stats, chart], api_name="generate")
        with gr.Tab("Chat vs code"):
            gr.Markdown("One held-out chat prompt and one code prompt through the same drafter: block drafters "
                        "accept far more on code, which is the difference AngelSpec is about.")
            cv_drafter = gr.Dropdown(list(drafters), value=next(iter(drafters), None), label="drafter")
            cv_tokens = gr.Slider(8, 256, value=64, step=8, label="max new tokens")
            cv_go = gr.Button("Compare chat and code")
            cv_table = gr.Dataframe(headers=["domain", "tau", "speedup", "identical"], label="chat vs code")
            cv_chart = gr.BarPlot(x="round", y="accepted", color="run", label="accepted draft tokens per round")
            cv_go.click(chat_vs_code, [cv_drafter, cv_tokens], [cv_table, cv_chart], api_name="chat_vs_code")
        # A documented endpoint for scripts (no UI of its own).
        api_inputs = [gr.Textbox(visible=False), gr.Textbox(visible=False), gr.Checkbox(visible=False),
                      gr.Number(visible=False)]
        api_output = gr.JSON(visible=False)
        gr.Button(visible=False).click(compare_api, api_inputs, api_output, api_name="compare")
    return demo.queue(default_concurrency_limit=1)


def main() -> None:
    from angelspec_hf.cli import target_display_name
    from angelspec_hf.generation import load_or_profile

    target, tokenizer, drafters = load_models()
    cost_model = load_or_profile(target, target_display_name("reference"))
    build_demo(target, tokenizer, drafters, cost_model).launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))


if __name__ == "__main__":
    main()
