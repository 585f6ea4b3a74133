"""The chat page's screenshots in README.md and docs/API.md, taken with the real catalog model: a DHT, two servers
of smollm2-135m-instruct (blocks 0:15 and 15:30), the gateway, and headless Chromium (tests/cdp.py) asking the page
a question whose answer has a code block; writes docs/img/chat.png (1280 px) and docs/img/chat-400px.png.

    python benchmarks/chat_screenshot.py [--model smollm2-135m-instruct] [--out docs/img]
"""
from __future__ import annotations

import argparse
import base64
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarmlm.api.process import GatewayProcess  # noqa: E402
from swarmlm.swarm.local import LocalSwarm  # noqa: E402
from swarmlm.types import BlockRange  # noqa: E402
from tests.cdp import Browser  # noqa: E402

LAST_ANSWER = "document.querySelector('#messages .msg.assistant:last-child')"
SYSTEM = "You are a concise assistant. Answer with a short Python example."
QUESTION = "How do I reverse a list in Python?"


def screenshot(page: Browser, path: Path) -> None:
    path.write_bytes(base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"]))
    print(f"wrote {path}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    parser.add_argument("--max-tokens", default="160")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swarmlm-shot-") as tmp:
        swarm = LocalSwarm(args.model, log_dir=Path(tmp) / "logs")
        try:
            swarm.start_dht()
            servers = [swarm.start_server(BlockRange(0, 15), wait=False),
                       swarm.start_server(BlockRange(15, 30), wait=False)]
            with GatewayProcess(args.model, swarm.initial_peers, log_path=Path(tmp) / "api.err") as gateway:
                swarm.wait_ready(servers)
                with Browser(Path(tmp) / "profile", timeout_s=300) as page:
                    page.open(f"{gateway.url}/chat")
                    page.wait_for("document.getElementById('model')?.textContent", what="the model name")
                    page.type_into("#system", SYSTEM)
                    page.type_into("#temperature", "0")
                    page.type_into("#max-tokens", args.max_tokens)
                    page.type_into("#prompt", QUESTION)
                    page.click("#send")
                    state = page.wait_for(f"{LAST_ANSWER}.dataset.state !== 'streaming' && {LAST_ANSWER}.dataset.state",
                                          timeout_s=600, what="the answer")
                    print(f"answer {state}: {page.eval(f'{LAST_ANSWER}.dataset.raw')!r}", file=sys.stderr)
                    screenshot(page, out / "chat.png")
                    page.call("Emulation.setDeviceMetricsOverride", width=400, height=800, deviceScaleFactor=1,
                              mobile=False)
                    page.wait_for("window.innerWidth === 400", what="the 400 px viewport")
                    screenshot(page, out / "chat-400px.png")
        finally:
            swarm.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
