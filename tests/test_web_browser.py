"""The chat page in a real browser: headless Chromium (Debian's package) driven through Selenium and
Debian's chromedriver, against a real `flashtree serve` of the embedded model with an API key.

One walk through the page, as a user would: give the key when asked, send a message and see the
streamed answer with its numbers, open its decoder view and hover a step's tree, give the model
tools and answer its call, stop a long answer (and see the engine count the generation cancelled), edit a message and resend it, and
read the dashboard. The screenshots are saved on the way: into the test's temporary folder, or,
with FLASHTREE_SCREENSHOTS=docs, over the ones the docs show (docs/images/), so that a test run
leaves the tracked files as they are.

Skipped where the browser is not installed, except under CI (`.ci/run` installs it): there a
missing browser is a failure, not a silent skip.
"""

import importlib.util
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flashtree.train.synth_tools import TOOLS
from serve_harness import Server

ROOT = Path(__file__).resolve().parents[1]
DOCS_IMAGES = ROOT / "docs" / "images"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
KEY = "browser-test-key"
QUESTION = "How do I reverse a string in Python?"  # the README's: the embedded model answers `[::-1]`
WEATHER = {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny", "humidity": 40}
WAIT_S = 90

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (ASSETS := ROOT / "flashtree" / "assets" / "target").is_dir(),
                                 reason="no embedded model in this checkout")]


def _missing_browser() -> str:
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[test]')"
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        return "chromium and chromedriver are not installed (apt-get install -y chromium chromium-driver)"
    return ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(None, None, tmp_path_factory.mktemp("web") / "server.log", max_ctx=4096, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    missing = _missing_browser()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1120,700", "--force-device-scale-factor=1", "--force-color-profile=srgb",
                "--blink-settings=preferredColorScheme=1"):  # light: the screenshots match the docs
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait(driver, condition, timeout=WAIT_S):
    """`condition`'s first truthy value; an element that a re-render replaced meanwhile (the page
    redraws a streaming answer every frame) only means: look again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=[StaleElementReferenceException]).until(lambda d: condition(d))


def css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def last_answer(driver):
    answers = css(driver, ".msg.assistant")
    return answers[-1] if answers else None


def answer_done(driver):
    """The last answer's text once its numbers are shown (the stream has ended)."""
    answer = last_answer(driver)
    if answer is None or css(driver, "#stop")[0].is_displayed():
        return None
    return answer.text if answer.find_elements("css selector", ".stats") else None


def send(driver, text):
    box = css(driver, "#input")[0]
    box.clear()
    box.send_keys(text)
    css(driver, "#send")[0].click()


def set_setting(driver, element_id, value):
    """Type `value` over the field's (keystrokes, so the page hears each change)."""
    from selenium.webdriver.common.keys import Keys

    field = css(driver, "#" + element_id)[0]
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACK_SPACE)
    if value:
        field.send_keys(value)


def traffic(server, seconds):
    """Three clients asking at once, again and again, for `seconds` (some wait in the queue)."""
    prompts = ["What is the capital of France?", "How do I reverse a string in Python?", "What is 12 + 30?"]
    deadline = time.monotonic() + seconds

    def ask(prompt):
        client = server.client()
        while time.monotonic() < deadline:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}], max_tokens=64)

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(ask, prompts))


def test_chat_page_end_to_end(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    images = DOCS_IMAGES if os.environ.get("FLASHTREE_SCREENSHOTS") == "docs" else tmp_path
    images.mkdir(parents=True, exist_ok=True)
    d = browser
    d.get(server.url + "/")

    # the server has --api-key: the page asks for it once, then every call carries it
    dialog = wait(d, lambda d: (css(d, "dialog.key-dialog input") or [None])[0])
    dialog.send_keys(KEY)
    css(d, "dialog.key-dialog button[value=ok]")[0].click()
    wait(d, lambda d: css(d, "#model-name")[0].text.strip())

    # a streamed answer, with Markdown and its numbers
    send(d, QUESTION)
    text = wait(d, answer_done)
    assert "[::-1]" in text
    assert css(d, ".msg.assistant .content pre code")  # the code block is rendered
    for part in ("tok/s", "prefill", "cached", "accept"):
        assert part in text, text

    # the decoder view: one span a step; hovering the longest step shows its tree
    css(d, ".msg.assistant .decoder-toggle")[0].click()
    spans = wait(d, lambda d: css(d, ".decoder .step"))
    assert "".join(s.text for s in spans).replace("\n", "")  # the raw output, coloured by step
    longest = max(spans, key=lambda s: int(next(c for c in s.get_attribute("class").split() if c.startswith("acc-"))[4:]))
    ActionChains(d).move_to_element(longest).perform()
    popup = wait(d, lambda d: next((p for p in css(d, ".tree-popup") if p.is_displayed()), None))
    assert popup.find_elements("css selector", ".node.accepted") and "tree of" in popup.text
    d.save_screenshot(str(images / "decoder-view.png"))
    ActionChains(d).move_to_element(css(d, "#topbar")[0]).perform()
    css(d, ".msg.assistant .decoder-toggle")[0].click()

    # tools: the call shows as a call, its result goes back from the form, the answer uses it
    css(d, "#settings-toggle")[0].click()
    d.execute_script("const t = document.getElementById('s-tools'); t.value = arguments[0];"
                     "t.dispatchEvent(new Event('input'));", json.dumps(TOOLS))
    css(d, "#settings-toggle")[0].click()
    send(d, "What's the weather like in Paris?")
    wait(d, answer_done)
    call = css(d, ".msg.assistant .tool-call")[-1]
    assert call.find_elements("css selector", ".fn")[0].text == "get_weather" and "Paris" in call.text
    call.find_elements("css selector", ".tool-result")[0].send_keys(json.dumps(WEATHER))
    css(d, ".send-results")[0].click()
    assert "18" in wait(d, lambda d: answer_done(d) if len(css(d, ".msg")) == 6 else None)
    d.set_window_size(1120, 900)
    time.sleep(0.3)
    d.save_screenshot(str(images / "chat.png"))
    d.set_window_size(1120, 700)
    css(d, "#settings-toggle")[0].click()
    d.execute_script("const t = document.getElementById('s-tools'); t.value = '';"
                     "t.dispatchEvent(new Event('input'));")
    css(d, "#settings-toggle")[0].click()

    # stop a long answer: sampled at temperature 2 the embedded model rambles for many seconds
    cancelled = server.metric("flashtree_generations_total", finish_reason="cancelled")
    css(d, "#new-chat")[0].click()
    css(d, "#settings-toggle")[0].click()
    set_setting(d, "s-temperature", "2")
    set_setting(d, "s-seed", "1")
    set_setting(d, "s-max-tokens", "3000")
    css(d, "#settings-toggle")[0].click()
    send(d, "Write a long story.")
    wait(d, lambda d: last_answer(d) is not None and last_answer(d).find_elements("css selector", ".content")[0].text.strip())
    css(d, "#stop")[0].click()
    assert "stopped" in wait(d, answer_done)
    wait(d, lambda d: server.metric("flashtree_generations_total", finish_reason="cancelled") > cancelled, 60)

    # conversations survive a reload (local storage); edit the first question and resend it
    for field, value in (("s-temperature", ""), ("s-seed", ""), ("s-max-tokens", "")):
        css(d, "#settings-toggle")[0].click()
        set_setting(d, field, value)
        css(d, "#settings-toggle")[0].click()
    d.refresh()
    titles = wait(d, lambda d: css(d, "#conversations .conv-title") if len(css(d, "#conversations li")) == 2 else None)
    titles[1].click()
    user = wait(d, lambda d: css(d, ".msg.user"))[0]
    ActionChains(d).move_to_element(user).perform()
    user.find_elements("css selector", ".edit")[0].click()
    area = css(d, ".editing textarea")[0]
    area.clear()
    area.send_keys("What is the capital of France?")
    css(d, ".editing .resend")[0].click()
    assert "Paris" in wait(d, lambda d: answer_done(d) if len(css(d, ".msg")) == 2 else None)

    # the dashboard reads /metrics with the stored key; traffic while it watches draws its plots
    d.set_window_size(1120, 1200)
    d.get(server.url + "/dashboard")
    wait(d, lambda d: any(t.get_attribute("data-metric") == "cancelled" and t.text.split()[0] != "0"
                          for t in css(d, ".tile")))
    traffic(server, seconds=12)
    d.save_screenshot(str(images / "dashboard.png"))
    assert "cannot read" not in css(d, "#status")[0].text
    for image in ("chat.png", "decoder-view.png", "dashboard.png"):
        assert (images / image).stat().st_size < 300_000, image
