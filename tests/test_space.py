"""The Gradio Space on tiny models: its API through gradio_client, and the page in headless Chromium."""

import importlib.util
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from angelspec_hf.generation import CostModel
from fitting import tiny_tokenizer

gr = pytest.importorskip("gradio", reason="the Space needs gradio (installed by `make install`)")
from gradio_client import Client  # noqa: E402

APP = Path(__file__).resolve().parents[1] / "spaces" / "app.py"
COST = CostModel(target="t", hardware="t", tokens=[1, 8], contexts=[0, 512], seconds=[[1.0, 1.0], [1.3, 1.3]])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def space(targets):
    spec = importlib.util.spec_from_file_location("angelspec_space_app", APP)
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    drafters = {"dfly": targets.fitted("llama", "dfly-hybrid-corr"), "mtp": targets.fitted("llama", "mtp")}
    demo = app.build_demo(targets.target("llama"), tiny_tokenizer(), drafters, COST)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield app, f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def test_compare_endpoint_returns_identical_text(space):
    _, url = space
    client = Client(url, verbose=False)
    for drafter, dcut in (("dfly", False), ("mtp", True)):
        result = client.predict("Write a function that adds two numbers.", drafter, dcut, 16, api_name="/compare")
        assert result["identical"] is True and result["speculative_text"] == result["plain_text"], result
        assert result["plain_tokens_per_s"] > 0 and result["speedup"] > 0
    with pytest.raises(Exception, match="Unknown drafter"):
        client.predict("hello", "nope", False, 8, api_name="/compare")


def test_streamed_generate_endpoint_ends_with_the_identity_check(space):
    _, url = space
    client = Client(url, verbose=False)
    for drafter in ("dfly", "router (all drafters, online)"):
        plain, speculative, stats, _ = client.predict("Tell me about rivers.", drafter, False, 12, api_name="/generate")
        assert "identical to plain decoding**: yes" in stats
        text = lambda pieces: "".join(piece["token"] for piece in pieces)  # noqa: E731
        assert text(speculative) == text(plain) and text(plain)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian `chromium` is not installed (make install adds it)")
def test_page_renders_in_headless_chromium(space, tmp_path):
    _, url = space
    result = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={tmp_path}", "--virtual-time-budget=20000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )
    dom = result.stdout
    for element in ("plain generation", "speculative generation", "Generate", "D-cut", "Chat vs code", "drafter"):
        assert element in dom, (element, result.stderr[-2000:])
