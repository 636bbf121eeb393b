#!/usr/bin/env python3
"""A screenshot of `tfm serve`'s page after a translation, in headless Chromium (selenium and
Debian's chromium + chromium-driver):

    python scripts/screenshot_page.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt -o docs/serve-page.png
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.errors import TfmError  # noqa: E402
from transformer_cli.runtime.files import check_output  # noqa: E402

TEXT = ("Ein Mann mit einem roten Hut fährt Fahrrad. Zwei Hunde spielen im Schnee.\n\n"
        "Eine Frau sitzt auf einer Bank und liest ein Buch.")


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/serve-page.png"))
    args = parser.parse_args()
    if not Path(args.checkpoint).is_file():
        raise TfmError(f"--checkpoint {args.checkpoint}: no such file")
    check_output(args.output, {"--checkpoint": [Path(args.checkpoint)]})
    try:
        from selenium import webdriver
    except ImportError:
        raise TfmError("screenshot_page.py needs selenium (pip install selenium) and Chromium") from None
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "transformer_cli.cli", "serve", "--checkpoint", args.checkpoint,
                               "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        options = webdriver.ChromeOptions()
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"):
            options.add_argument(flag)
        options.binary_location = shutil.which("chromium") or shutil.which("google-chrome") or ""
        driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
        try:
            driver.set_window_size(1000, 620)
            driver.get(f"http://127.0.0.1:{port}/")
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: d.find_element(By.ID, "languages").text.startswith("Translates"))
            driver.find_element(By.ID, "source").send_keys(TEXT)
            driver.find_element(By.ID, "translate").click()
            wait.until(lambda d: d.find_element(By.ID, "target").get_attribute("value"))
            driver.save_screenshot(str(args.output))
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"→ {args.output}")


if __name__ == "__main__":
    run_script(main)
