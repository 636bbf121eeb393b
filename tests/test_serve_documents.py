"""Documents through `tfm serve`: "format" in /translate, POST /translate/file, and the page at /,
in a real headless browser where one is installed."""

from __future__ import annotations

import json
import re
import shutil
import urllib.parse
import urllib.request
from pathlib import Path

import lxml.etree
import pytest

from tests.conftest import fp32_translator, tfm_in_process
from tests.test_serve import Server
from tests.test_serve_abuse import send

pytest.importorskip("prometheus_client", reason="tfm serve needs the [serve] extra (CI installs it with [test])")

LINES = ["wa wb wc wd", "we wf wg", "wh wi wj wk wl"]


@pytest.fixture(scope="module")
def served(reverse_model, tmp_path_factory):
    """A server on the default engine (CTranslate2 where installed: markup goes to tfm's engine beside
    it, for the alignments), with API keys; the reverse model's fp32 translations of LINES."""
    root = tmp_path_factory.mktemp("documents")
    result = tfm_in_process("api-key", "--api-keys", root / "keys.txt", "--name", "page")
    assert result.exit_code == 0, result.stderr
    server = Server(reverse_model[1].best_checkpoint, "--api-keys", str(root / "keys.txt"), "--max-lines", "64")
    expected = [t[0].text for t in fp32_translator(reverse_model[1].best_checkpoint).translate(LINES)]
    yield server, {"Authorization": f"Bearer {result.stdout.strip()}"}, expected, root
    code, stderr = server.stop()
    assert code == 0 and "Traceback" not in stderr, stderr


def test_a_document_request_keeps_its_structure_and_translates_its_sentences(served):
    server, key, expected, _ = served
    text = f"  {LINES[0]}\n\n\n{LINES[1]}\n\n{LINES[2]}\n"
    status, answer, _ = send(server.port, json.dumps({"text": [text, ""], "format": "text"}).encode(), headers=key)
    assert status == 200, answer
    assert answer["translations"] == [f"  {expected[0]}\n\n\n{expected[1]}\n\n{expected[2]}\n", ""]


def test_html_through_the_server_keeps_every_tag_once_around_its_word(served):
    server, key, expected, _ = served
    words = LINES[0].split()
    page = f'<p>{words[0]} <b class="x">{words[1]}</b> {words[2]} {words[3]}</p>\n<ul><li>{LINES[1]}</li></ul>'
    status, answer, _ = send(server.port, json.dumps({"text": page, "format": "html"}).encode(), headers=key)
    assert status == 200, answer
    out = answer["translations"][0]
    root = lxml.etree.fromstring(f"<div>{out}</div>")
    assert len(root.findall(".//b[@class='x']")) == 1 and root.find(".//li").text == expected[1]
    assert " ".join(re.sub("<[^>]+>", "", out).split()[:4]) == expected[0]


@pytest.mark.parametrize("name, body, status, says", [
    ("film.pdf", b"%PDF", 415, "not text"),
    ("noext", b"wa wb", 415, "give a document"),
    ("doc.txt", b"wa\0wb", 422, "NUL"),
    ("bad.xml", b"<doc><a>wa</doc>", 422, "not well-formed XML"),
    ("big.txt", ("wa. " * 70).encode(), 413, "lines"),
    ("nocues.srt", b"wa wb wc.\n\nwd we.\n", 422, "line 1: text without a timing line"),
    ("page.md", b"<html><body><p>wa wb</p></body></html>", 422, "nothing to translate found"),
])
def test_a_bad_file_is_a_one_line_error(served, name, body, status, says):
    server, key, _, _ = served
    answer = send(server.port, body, headers=key, path=f"/translate/file?name={urllib.parse.quote(name)}")
    assert answer[0] == status and says in answer[1]["error"], answer


@pytest.mark.parametrize("request_body, says", [
    ({"text": "<p>wa wb</p>", "format": "html", "alignment": True}, "alignment are for requests of lines"),
    ({"text": "<p>wa wb</p>", "format": "html", "nbest": 2, "beam": 2}, "nbest are for requests of lines"),
    ({"text": "wa wb", "format": "text", "avoid": ["wa"]}, "avoid are for requests of lines"),
    ({"text": "wa wb.\n\nwc wd.", "format": "srt"}, "line 1: text without a timing line"),
    ({"text": "<html><p>wa wb</p></html>", "format": "markdown"}, "nothing to translate found"),
])
def test_a_document_request_it_cannot_honour_is_422_never_a_copy_of_the_input(served, request_body, says):
    server, key, _, _ = served
    status, answer, _ = send(server.port, json.dumps(request_body).encode(), headers=key)
    assert status == 422 and says in answer["error"], answer


def test_a_subtitle_file_comes_back_translated_with_its_timings_and_a_safe_name(served):
    server, key, expected, _ = served
    srt = f"1\n00:00:01,000 --> 00:00:02,500\n{LINES[0]}\n\n2\n00:00:03,000 --> 00:00:04,000\n{LINES[1]}\n"
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/translate/file?name="
                                     + urllib.parse.quote('../x/"film.de.srt'), data=srt.encode(), headers=key)
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers["Content-Disposition"] == 'attachment; filename="film.de.tgt.srt"'
        assert answer.headers.get_content_type() == "application/x-subrip"
        out = answer.read().decode()
    assert [line for line in out.splitlines() if "-->" in line] == [line for line in srt.splitlines() if "-->" in line]
    assert expected[0] in out.replace("\n", " ") or expected[0].split()[0] in out


def test_the_page_needs_no_key_and_nothing_from_elsewhere(served):
    server, _, _, _ = served
    status, answer, _ = send(server.port, None, path="/")
    page = answer["text"]
    assert status == 200 and "<textarea" in page and "/translate/file" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page) and "@import" not in page
    assert send(server.port, None, path="/languages")[0] == 401  # the API behind it still needs the key


def browser():
    """Headless Chromium driven by Selenium, or the reason there is none."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test needs selenium (the test extra)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("no Chromium and ChromeDriver on this machine (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"):
        options.add_argument(flag)
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(options=options, service=Service(driver_path))


def test_the_page_in_a_real_browser_translates_text_and_a_file(served, tmp_path):
    server, key, expected, root = served
    driver = browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        driver.set_window_size(1100, 760)
        driver.get(f"http://127.0.0.1:{server.port}/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.ID, "key-row").is_displayed())  # 401: it asks for the key
        driver.find_element(By.ID, "key").send_keys(key["Authorization"].split()[1])
        driver.find_element(By.ID, "use-key").click()
        wait.until(lambda d: d.find_element(By.ID, "languages").text.startswith("Translates from"))
        driver.find_element(By.ID, "source").send_keys(f"{LINES[0]}\n\n{LINES[1]}")
        driver.find_element(By.ID, "translate").click()
        wait.until(lambda d: d.find_element(By.ID, "target").get_attribute("value"))
        assert driver.find_element(By.ID, "target").get_attribute("value") == f"{expected[0]}\n\n{expected[1]}"
        upload = tmp_path / "page.html"
        upload.write_text(f"<p>{LINES[2]}</p>\n")
        driver.find_element(By.ID, "file").send_keys(str(upload))
        driver.find_element(By.ID, "translate-file").click()
        wait.until(lambda d: d.find_element(By.ID, "download").is_displayed())
        link = driver.find_element(By.ID, "download")
        assert link.get_attribute("download") == "page.tgt.html"
        got = driver.execute_async_script(
            "fetch(arguments[0]).then(r => r.text()).then(arguments[arguments.length - 1])", link.get_attribute("href"))
        assert got == f"<p>{expected[2]}</p>\n"
        driver.save_screenshot(str(root / "page.png"))
        assert (root / "page.png").stat().st_size > 1000
    finally:
        driver.quit()


def test_markup_needs_alignments_a_server_on_ctranslate2_alone_cannot_make(reverse_model):
    pytest.importorskip("ctranslate2")
    server = Server(reverse_model[1].best_checkpoint, "--engine", "ctranslate2", fp32=False)
    try:
        status, answer, _ = send(server.port, json.dumps({"text": "<p>wa <b>wb</b></p>", "format": "html"}).encode())
        assert status == 422 and "tfm's own engine" in answer["error"], answer
        status, answer, _ = send(server.port, json.dumps({"text": f"{LINES[0]}\n\n{LINES[1]}", "format": "text"}).encode())
        assert status == 200 and answer["translations"][0].count("\n\n") == 1, answer
    finally:
        code, stderr = server.stop()
        assert code == 0 and "Traceback" not in stderr, stderr


def test_health_answers_within_a_second_while_the_worst_document_of_each_format_is_read(served):
    """One 160 kB upload of `<!--` froze the whole server for 78 s (one regex call holding the GIL):
    /health timed out. Each format's worst input, while /health is asked every 0.2 s."""
    import io
    import threading
    import time
    import zipfile

    from tests.test_documents import word_document

    server, key, _, _ = served
    namespace = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
    docx = io.BytesIO()
    with zipfile.ZipFile(docx, "w", zipfile.ZIP_DEFLATED) as archive:
        original = zipfile.ZipFile(io.BytesIO(word_document()))
        for info in original.infolist():
            if info.filename != "word/document.xml":
                archive.writestr(info, original.read(info))
        archive.writestr("word/document.xml", f"<w:document {namespace}><w:body>"
                         + "<w:p><w:r><w:t>wa</w:t></w:r></w:p>" * 100_001 + "</w:body></w:document>")
    worst = {"a.html": b"<!--" * 40_000, "a.md": b"<!--" * 40_000,
             "a.srt": b"1\n00:00:01,000 --> 00:00:02,000\n" + b"<b>" * 20_000 + b"wa" + b"</x>" * 20_000 + b"\n",
             "a.docx": docx.getvalue()}
    for name, body in worst.items():
        answered: list = []

        def upload(body: bytes = body, name: str = name, answered: list = answered) -> None:
            answered.append(send(server.port, body, headers=key, path=f"/translate/file?name={name}", timeout=120))

        sender = threading.Thread(target=upload)
        sender.start()
        waits = []
        while sender.is_alive():
            waits.append(send(server.port, None, path="/health", timeout=10)[2])
            time.sleep(0.2)
        sender.join()
        assert answered and answered[0][0] in (200, 413, 422), (name, answered)
        assert max(waits, default=0.0) < 1.0, (name, waits, answered[0][2])
        assert answered[0][2] < 30, (name, answered[0][2])


def pid_then_sleep(path: str, seconds: float) -> None:
    """A document step that never ends in time: it writes its process id, then sleeps."""
    import os
    import time

    Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)


def test_a_document_step_past_its_deadline_is_killed_and_a_refusal_comes_back_as_raised(tmp_path):
    """Documents are read in processes of their own: a deadline stops one (the process is killed,
    not left to run on), and what the reader refuses reaches the request as its status and line."""
    import asyncio
    import os
    import time

    from transformer_cli.decoding.budget import DeadlinePassed
    from transformer_cli.serve.documents import IN_THREAD_CHARS, DocumentProcesses, sentences_of
    from transformer_cli.serve.requests import RequestError

    processes = DocumentProcesses(at_once=2)
    # a process started and this module imported in it first: on a loaded machine that took over the 3 s
    # below, and the step never ran
    asyncio.run(processes.run(pid_then_sleep, (str(tmp_path / "warm"), 0.0), time.monotonic() + 120, IN_THREAD_CHARS + 1))
    started = time.monotonic()
    with pytest.raises(DeadlinePassed):
        asyncio.run(processes.run(pid_then_sleep, (str(tmp_path / "pid"), 60.0), time.monotonic() + 3.0, word=True))
    assert time.monotonic() - started < 10
    pid = int((tmp_path / "pid").read_text())
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text(), "the step runs on past its deadline"
    with pytest.raises(RequestError) as refused:
        asyncio.run(processes.run(sentences_of, ([("<p>wa</p>", "docx")], None, None), time.monotonic() + 30,
                                  word=True))
    assert refused.value.status == 422 and str(refused.value) == "text 1: a Word document is a file: send its bytes"
    large = IN_THREAD_CHARS + 1  # a document read in a process
    planned = asyncio.run(processes.run(sentences_of, ([("<p>wa <b>wb</b>. wc</p>", "html")], None, None),
                                        time.monotonic() + 30, large))
    assert [plan.sentences for plan in planned] == [["wa wb.", "wc"]] and planned[0].alignment
    # steps reuse their process; one that read a large document renews it (its memory goes with it)
    soon = time.monotonic() + 30
    first, again = (asyncio.run(processes.run(os.getpid, (), soon, large)) for _ in range(2))
    assert first == again != os.getpid() and first != pid
    assert asyncio.run(processes.run(os.getpid, (), soon, chars=2 << 20)) == first
    assert asyncio.run(processes.run(os.getpid, (), soon, large)) != first
    assert asyncio.run(processes.run(os.getpid, (), soon)) == os.getpid()  # a small text: on a thread
    processes.close()


def test_a_document_read_past_the_request_timeout_is_504_and_the_next_documents_are_served(reverse_model):
    """The deadline reaches the document processes through the server: a document whose reading runs
    past --request-timeout gets 504 with the line saying so, its process is killed, and the next
    documents (a small one on a thread, one over 16 kB in the process that took its place) are served."""
    from transformer_cli.serve.documents import IN_THREAD_CHARS

    server = Server(reverse_model[1].best_checkpoint, "--request-timeout", "0.5")
    try:
        slow = b"<p>" + b"<b>wa</b> " * 100_000 + b"</p>"  # 1 MB of markup: ~1.8 s to read on a Zen 4
        status, answer, seconds = send(server.port, slow, path="/translate/file?name=a.html", timeout=60)
        assert status == 504 and "reading the document ran past 0.5 s" in answer["error"], (status, answer)
        assert seconds < 10, seconds
        small = b"<p>wa wb</p>"
        large = b"<!-- " + b"x" * IN_THREAD_CHARS + b" --><p>wa wb</p>"
        for body in (small, large):
            status, answer, _ = send(server.port, body, path="/translate/file?name=b.html", timeout=60)
            assert status == 200 and answer["text"].count("<p>") == 1, (len(body), status, answer)
    finally:
        code, stderr = server.stop()
    assert code == 0 and "Traceback" not in stderr, stderr
