"""The explorer's page in headless Chromium (Debian's chromium + chromium-driver, driven by
python3-selenium) against a real `qkv serve` on 127.0.0.1: type a sentence, move the temperature
slider, toggle causal, hover and read weights from the keyboard, show a trained model; every
number on the page is checked against what the API answers for the same request.

Screenshots go to $QKV_OUT/screenshots (docs/explorer.md shows copies of them). Skips, saying
why, only when Chromium, its driver or Selenium is not installed (scripts/install-deps.sh
installs them on Debian).
"""
import json
import math
import os
import shutil
import tempfile

import pytest

from conftest import QKV_MODEL, QKV_OUT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait
    SELENIUM = True
except ImportError:
    SELENIUM = False

if not (CHROMIUM and CHROMEDRIVER and SELENIUM):
    pytest.skip("the browser test needs chromium, chromium-driver and python3-selenium, and "
                f"{'chromium' if not CHROMIUM else 'chromedriver' if not CHROMEDRIVER else 'selenium'} is not "
                "installed (Debian: apt-get install chromium chromium-driver python3-selenium, or make deps)",
                allow_module_level=True)

SCREENSHOTS = os.path.join(QKV_OUT or tempfile.gettempdir(), "screenshots")
WHITE = "rgb(255, 255, 255)"  # the colour scale's 0 (explorer.js)


@pytest.fixture
def browser():
    profile = tempfile.mkdtemp(prefix="qkv-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,2400", f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def renders(driver):
    return int(driver.execute_script("return document.body.dataset.renders || '0'"))


def wait_render(driver, after, what):
    """Waits for a render newer than `after` (set by explorer.js after each answer); its request."""
    WebDriverWait(driver, 20).until(lambda d: renders(d) > after and d.find_element(By.ID, "error").get_attribute("hidden"),
                                    f"the page did not redraw after {what}")
    return json.loads(driver.execute_script("return document.body.dataset.request"))


def cells(driver, head):
    """{(query, key): (weight, fill)} of one heatmap panel, as the page draws it."""
    data = driver.execute_script("""
        return Array.from(document.querySelectorAll(`.panel[data-head="${arguments[0]}"] rect.cell`))
          .map(c => [Number(c.dataset.q), Number(c.dataset.k), c.dataset.w, c.getAttribute('fill')]);""", str(head))
    return {(q, k): (float(w), fill) for q, k, w, fill in data}


def luminance(fill):
    r, g, b = (int(x) for x in fill[4:-1].split(","))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def check_page_matches_api(driver, server, request):
    """Every drawn cell of every head holds the API's weight, and darker means heavier."""
    status, answer = server.attention(request)
    assert status == 200, answer
    for h, head in enumerate(answer["weights"]):
        drawn = cells(driver, h)
        assert len(drawn) == len(head) ** 2
        for (q, k), (w, _) in drawn.items():
            assert w == pytest.approx(head[q][k], abs=1e-6), (h, q, k)
        by_weight = sorted(drawn.values())
        for (w1, f1), (w2, f2) in zip(by_weight, by_weight[1:]):
            assert luminance(f2) <= luminance(f1) + 1e-9, f"heavier {w2} drawn lighter than {w1}"
    entropies = [float(e.text.split()[1]) for e in driver.find_elements(By.CSS_SELECTOR, ".panel .entropy")]
    assert entropies[:len(answer["entropy"])] == pytest.approx(answer["entropy"], abs=0.006)
    return answer


def screenshot(element, name):
    os.makedirs(SCREENSHOTS, exist_ok=True)
    path = os.path.join(SCREENSHOTS, name)
    assert element.screenshot(path), path
    assert os.path.getsize(path) > 1000


def test_temperature_and_causal_in_a_real_browser(server, browser):
    browser.get(server.url + "/")
    wait_render(browser, 0, "loading the page")

    # Type a sentence, as a learner would.
    before = renders(browser)
    text = browser.find_element(By.ID, "text")
    text.clear()
    text.send_keys("the cat sat on the mat")
    request = wait_render(browser, before, "typing")
    WebDriverWait(browser, 20).until(lambda d: json.loads(d.execute_script("return document.body.dataset.request"))["text"]
                                     == "the cat sat on the mat")
    request = json.loads(browser.execute_script("return document.body.dataset.request"))
    assert request["temperature"] == 1
    at_one = check_page_matches_api(browser, server, request)
    labels = [t.text for t in browser.find_elements(By.CSS_SELECTOR, '.panel[data-head="0"] svg > text')]
    assert labels[:2] == ["the", "the"] and "mat" in labels  # rows and columns are labelled with the tokens
    cells_at_one = cells(browser, 0)

    # The slider, by keyboard: Home is T = 0.05 (nearly one-hot), End is T = 5 (nearly uniform).
    slider = browser.find_element(By.ID, "temperature")
    before = renders(browser)
    slider.send_keys(Keys.HOME)
    request = wait_render(browser, before, "moving the slider to the left end")
    assert request["temperature"] == 0.05 and browser.find_element(By.ID, "temperature-value").text == "0.05"
    cold = check_page_matches_api(browser, server, request)
    assert cells(browser, 0) != cells_at_one, "the heatmap did not change with the temperature"
    top = [max(row) for head in cold["weights"] for row in head]
    assert sum(top) / len(top) > 0.9, "at T = 0.05 most rows should put nearly all weight on one key"
    assert max(cold["entropy"]) < min(at_one["entropy"])
    screenshot(browser.find_element(By.ID, "heatmaps-section"), "explorer-cold.png")

    before = renders(browser)
    slider.send_keys(Keys.END)
    request = wait_render(browser, before, "moving the slider to the right end")
    assert request["temperature"] == 5
    hot = check_page_matches_api(browser, server, request)
    assert min(hot["entropy"]) > 0.9 * math.log(6), "at T = 5 every head should be nearly uniform"

    # Back to T = 1 with its button, then causal: the upper triangle empties.
    before = renders(browser)
    browser.find_element(By.CSS_SELECTOR, '[data-temperature="1"]').click()
    wait_render(browser, before, "the T = 1 button")
    before = renders(browser)
    browser.find_element(By.ID, "mask-causal").click()
    request = wait_render(browser, before, "choosing causal")
    assert request["mask"] == "causal" and request["temperature"] == 1
    check_page_matches_api(browser, server, request)
    heads = len(browser.find_elements(By.CSS_SELECTOR, ".panel"))
    assert heads == 9  # 8 heads and their average
    for panel in browser.find_elements(By.CSS_SELECTOR, ".panel"):
        drawn = cells(browser, panel.get_attribute("data-head"))
        for (q, k), (w, fill) in drawn.items():
            if k > q:
                assert w == 0 and fill == WHITE, (q, k, w, fill)
            else:
                assert w > 0, (q, k)
    screenshot(browser.find_element(By.ID, "heatmaps-section"), "explorer-causal.png")

    # Exact weights: on hover, and from the keyboard (focus a heatmap, arrow keys).
    status, answer = server.attention(request)
    cell = browser.find_element(By.CSS_SELECTOR, '.panel[data-head="2"] rect.cell[data-q="3"][data-k="1"]')
    ActionChains(browser).move_to_element(cell).perform()
    tooltip = browser.find_element(By.ID, "tooltip")
    WebDriverWait(browser, 10).until(lambda d: tooltip.is_displayed())
    assert tooltip.text == f'head 2: "on" (query 3) \u2192 "cat" (key 1) = {answer["weights"][2][3][1]:.6f}'
    heatmap = browser.find_element(By.CSS_SELECTOR, '.panel[data-head="0"] svg')
    browser.execute_script("arguments[0].focus()", heatmap)
    ActionChains(browser).send_keys(Keys.ARROW_DOWN, Keys.ARROW_DOWN, Keys.ARROW_RIGHT).perform()
    readout = browser.find_element(By.ID, "readout").text
    assert readout == f'head 0: "sat" (query 2) \u2192 "cat" (key 1) = {answer["weights"][0][2][1]:.6f}'

    # The head view: one line per visible weight, thicker for heavier.
    Select(browser.find_element(By.ID, "headview-head")).select_by_value("0")
    lines = browser.execute_script("""return Array.from(document.querySelectorAll('#headview line'))
        .map(l => [Number(l.dataset.q), Number(l.dataset.k), Number(l.getAttribute('stroke-width'))]);""")
    assert lines and all(k <= q for q, k, _ in lines)  # causal: no line to a later token
    widths = {(q, k): w for q, k, w in lines}
    heaviest = max(widths, key=lambda qk: answer["weights"][0][qk[0]][qk[1]])
    assert widths[heaviest] == max(widths.values())
    screenshot(browser.find_element(By.ID, "headview-section"), "explorer-headview.png")

    # A bad mask expression: the API's 400 message, on the page, pointing at the token.
    before_errors = int(browser.execute_script("return document.body.dataset.errors || '0'"))
    browser.find_element(By.ID, "mask-expression").click()
    expression = browser.find_element(By.ID, "mask-text")
    expression.clear()
    expression.send_keys("causal & windw(2)")
    WebDriverWait(browser, 20).until(
        lambda d: int(d.execute_script("return document.body.dataset.errors || '0'")) > before_errors)
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed() and "column 10, found 'windw'" in error.text
    before = renders(browser)
    expression.send_keys(Keys.BACKSPACE * len("windw(2)"), "window(2)")
    request = wait_render(browser, before, "fixing the expression")
    assert request["mask"] == "causal & window(2)" and not error.is_displayed()


def test_a_trained_model_layer_by_layer(server, browser):
    browser.get(server.url + "/")
    wait_render(browser, 0, "loading the page")
    before = renders(browser)
    text = browser.find_element(By.ID, "text")
    text.clear()
    text.send_keys("b a d | b a")
    Select(browser.find_element(By.ID, "source")).select_by_value(os.path.basename(QKV_MODEL))
    WebDriverWait(browser, 20).until(lambda d: renders(d) > before and "model" in json.loads(
        d.execute_script("return document.body.dataset.request")) and json.loads(
        d.execute_script("return document.body.dataset.request"))["text"] == "b a d | b a")
    assert not browser.find_element(By.ID, "temperature").is_enabled()  # a model runs as trained
    thumbs = browser.find_elements(By.CSS_SELECTOR, "#overview canvas.thumb")
    assert len(thumbs) == 2 * 4  # layers x heads
    request = json.loads(browser.execute_script("return document.body.dataset.request"))
    status, answer = server.attention(request)
    assert status == 200 and answer["tokens"] == ["b", "a", "d", "|", "b", "a"]
    for h, head in enumerate(answer["layers"][0]["weights"]):
        for (q, k), (w, _) in cells(browser, h).items():
            assert w == pytest.approx(head[q][k], abs=1e-6)
    # Enter on layer 1's thumbnail shows layer 1 above.
    thumbs[4].send_keys(Keys.ENTER)
    assert Select(browser.find_element(By.ID, "layer")).first_selected_option.text == "layer 1"
    for h, head in enumerate(answer["layers"][1]["weights"]):
        for (q, k), (w, _) in cells(browser, h).items():
            assert w == pytest.approx(head[q][k], abs=1e-6)
    screenshot(browser.find_element(By.ID, "overview-section"), "explorer-model-overview.png")
    browser.execute_script("window.scrollTo(0, 0)")
    os.makedirs(SCREENSHOTS, exist_ok=True)
    assert browser.save_screenshot(os.path.join(SCREENSHOTS, "explorer-page.png"))
