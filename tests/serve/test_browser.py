"""The explorer's page in headless Chromium (Debian's chromium + chromium-driver, driven by
python3-selenium) against a real `qkv serve` on 127.0.0.1: type a sentence, move the temperature
slider, toggle causal, hover and read weights from the keyboard, show a trained model. The
heatmaps are canvases: every drawn cell's pixel (getImageData, over the hatching's background
image) is checked against the colour of the API's weight for the same request, masked pairs
against the hatched grey; the fixed colour scale against the per-panel stretch; and the
input-to-redraw time the page measures.

Screenshots go to $QKV_OUT/screenshots (docs/explorer.md shows copies of them). Skips, saying
why, only when Chromium, its driver or Selenium is not installed (scripts/install-deps.sh
installs them on Debian).
"""
import json
import math
import os
import shutil
import statistics
import tempfile
import time

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
# explorer.js's colour scale, white (0) to dark blue (1), and its masked cells' grey and hatching.
RAMP = [(255, 255, 255), (198, 219, 239), (107, 174, 214), (33, 113, 181), (8, 48, 107)]
WHITE = RAMP[0]
MASKED, HATCH = (222, 222, 222), (140, 140, 140)


def ramp(t):
    """The colour explorer.js draws for t in [0, 1] (its rampRgb, Math.round included)."""
    t = min(1.0, t) if t > 0 else 0.0
    x = t * (len(RAMP) - 1)
    i = min(len(RAMP) - 2, math.floor(x))
    f = x - i
    return tuple(math.floor(a + (b - a) * f + 0.5) for a, b in zip(RAMP[i], RAMP[i + 1]))


@pytest.fixture
def browser():
    profile = tempfile.mkdtemp(prefix="qkv-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,2400", "--force-device-scale-factor=1",
                 f"--user-data-dir={profile}"]:
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


def cell_pixels(driver, head, centre_only=True):
    """{(query, key): [(r, g, b), ...]} of one heatmap panel: the pixel at each cell's centre, or
    (centre_only=False) every pixel of the cell, as the page composes them: its cells canvas
    (`canvas.cells`, one pixel per weight, read back with getImageData, scaled up `cell` times
    without smoothing) over the canvas's CSS background (the masked pairs' hatching, read back from
    the background image the browser has) where the canvas is transparent."""
    data = driver.execute_async_script("""
        const [head, centreOnly, done] = arguments, g = window.qkvExplorer.geometry(), n = g.n, cell = g.cell;
        const canvas = document.querySelector(`.panel[data-head="${head}"] canvas.cells`);
        const cells = canvas.getContext('2d').getImageData(0, 0, n, n).data;
        const background = getComputedStyle(canvas).backgroundImage;
        const read = (tile) => {
          const pixel = (q, k, x, y) => {
            const o = 4 * (q * n + k);
            if (cells[o + 3] === 255) return [cells[o], cells[o + 1], cells[o + 2]];
            if (cells[o + 3] !== 0) return [-1, -1, -1];  // half transparent: never drawn so
            if (!tile) return [255, 255, 255];
            const t = 4 * ((y % tile.height) * tile.width + (x % tile.width));
            return [tile.data[t], tile.data[t + 1], tile.data[t + 2]];
          };
          const out = [];
          for (let q = 0; q < n; q++) for (let k = 0; k < n; k++) {
            const pixels = [];
            const span = centreOnly ? [Math.floor(cell / 2)] : [...Array(cell).keys()];
            for (const dy of span) for (const dx of span) pixels.push(pixel(q, k, k * cell + dx, q * cell + dy));
            out.push([q, k, pixels]);
          }
          done(out);
        };
        if (background === 'none') { read(null); return; }
        const image = new Image();
        image.src = background.slice(5, -2);
        image.decode().then(() => {
          const c = document.createElement('canvas');
          c.width = image.width; c.height = image.height;
          const ctx = c.getContext('2d');
          ctx.drawImage(image, 0, 0);
          read(ctx.getImageData(0, 0, c.width, c.height));
        });""", str(head), centre_only)
    return {(q, k): [tuple(p) for p in pixels] for q, k, pixels in data}


def luminance(rgb):
    r, g, b = rgb
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def saturation(rgb):
    return (max(rgb) - min(rgb)) / max(1, max(rgb))


def close(a, b, tolerance=1):
    return all(abs(x - y) <= tolerance for x, y in zip(a, b))


def panel_weights(answer, layer=None):
    """The weights of every panel the page shows: the heads, then their average."""
    heads = answer["weights"] if layer is None else answer["layers"][layer]["weights"]
    if len(heads) == 1:
        return {0: heads[0]}
    n = len(heads[0])
    average = answer.get("average") if layer is None else [[sum(h[i][j] for h in heads) / len(heads) for j in range(n)]
                                                            for i in range(n)]
    return {**dict(enumerate(heads)), "average": average}


def check_page_matches_api(driver, server, request, layer=None):
    """Every drawn cell of every panel has the colour of the API's weight on the fixed 0-1 scale,
    and every pair the API says is masked is drawn grey or hatched, not in the scale."""
    status, answer = server.attention(request)
    assert status == 200, answer
    visible = answer["visible"]
    for head, weights in panel_weights(answer, layer).items():
        drawn = cell_pixels(driver, head)
        assert len(drawn) == len(weights) ** 2
        for (q, k), (pixel,) in drawn.items():
            if visible[q][k] == "1":
                assert close(pixel, ramp(weights[q][k])), (head, q, k, weights[q][k], pixel)
            else:
                assert weights[q][k] == 0 and pixel in (MASKED, HATCH), (head, q, k, pixel)
    if layer is None:
        entropies = [float(e.text.split()[1]) for e in driver.find_elements(By.CSS_SELECTOR, ".panel .entropy")]
        assert entropies[:len(answer["entropy"])] == pytest.approx(answer["entropy"], abs=0.006)
    return answer


def head_view(driver):
    """What the head view's canvas shows (headview.js's window.qkvHeadView): x1, x2, ys (each
    token's y), colours per head, focus, and lines [head, query, key, width, opacity]."""
    return driver.execute_script("return window.qkvHeadView()")


def head_view_pixels(driver, points):
    """[r, g, b, a] of the head view's canvas at each (x, y) in CSS pixels."""
    return driver.execute_script("""const c = document.querySelector('#headview canvas'), d = window.devicePixelRatio || 1;
        const g = c.getContext('2d');
        return arguments[0].map(([x, y]) => Array.from(g.getImageData(Math.floor(x * d), Math.floor(y * d), 1, 1).data));""",
                                 [list(p) for p in points])


def weight_in(text):
    """The number after '= ' in a tooltip or read-out."""
    return float(text.rsplit("= ", 1)[1])


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
    geometry = browser.execute_script("return window.qkvExplorer.geometry()")
    assert geometry["labels"] == [[i, t] for i, t in enumerate(at_one["tokens"])]  # every token labels its row and column
    cells_at_one = cell_pixels(browser, 0)

    # The slider, by keyboard: Home is T = 0.05 (nearly one-hot), End is T = 5 (nearly uniform).
    slider = browser.find_element(By.ID, "temperature")
    before = renders(browser)
    slider.send_keys(Keys.HOME)
    request = wait_render(browser, before, "moving the slider to the left end")
    assert request["temperature"] == 0.05 and browser.find_element(By.ID, "temperature-value").text == "0.05"
    cold = check_page_matches_api(browser, server, request)
    assert cell_pixels(browser, 0) != cells_at_one, "the heatmap did not change with the temperature"
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
        for (q, k), (pixel,) in cell_pixels(browser, panel.get_attribute("data-head")).items():
            if k > q:
                assert pixel in (MASKED, HATCH), (q, k, pixel)  # masked: grey, hatched
            else:
                assert pixel not in (MASKED, HATCH), (q, k, pixel)
    assert browser.find_element(By.ID, "mask-applied").text == "causal"
    screenshot(browser.find_element(By.ID, "heatmaps-section"), "explorer-causal.png")

    # Exact weights: on hover, and from the keyboard (focus a heatmap, arrow keys).
    status, answer = server.attention(request)
    canvas = browser.find_element(By.CSS_SELECTOR, '.panel[data-head="2"] canvas')
    g = browser.execute_script("return window.qkvExplorer.geometry()")
    side = canvas.size["width"]

    def hover(q, k):
        ActionChains(browser).move_to_element_with_offset(
            canvas, round((k + 0.5) * g["cell"] - side / 2), round((q + 0.5) * g["cell"] - side / 2)).perform()
        tooltip = browser.find_element(By.ID, "tooltip")
        WebDriverWait(browser, 10).until(lambda d: tooltip.is_displayed())
        return tooltip.text

    text = hover(3, 1)
    assert text.startswith('head 2: "on" (query 3) \u2192 "cat" (key 1) = ')
    assert weight_in(text) == pytest.approx(answer["weights"][2][3][1], rel=1e-3)
    assert hover(1, 3) == 'head 2: "cat" (query 1) \u2192 "on" (key 3): masked, no weight'
    heatmap = browser.find_element(By.CSS_SELECTOR, '.panel[data-head="0"] canvas')
    browser.execute_script("arguments[0].focus()", heatmap)
    ActionChains(browser).send_keys(Keys.ARROW_DOWN, Keys.ARROW_DOWN, Keys.ARROW_RIGHT).perform()
    readout = browser.find_element(By.ID, "readout").text
    assert readout.startswith('head 0: "sat" (query 2) \u2192 "cat" (key 1) = ')
    assert weight_in(readout) == pytest.approx(answer["weights"][0][2][1], rel=1e-3)
    assert browser.find_element(By.CSS_SELECTOR, '.panel[data-head="0"] .cursor').is_displayed()

    # The head view (a canvas): one line per weight of at least 1% of the head's largest, thicker
    # for heavier; drawn where it says, and only the hovered query's lines while one is hovered.
    Select(browser.find_element(By.ID, "headview-head")).select_by_value("0")
    view = head_view(browser)
    weights = answer["weights"][0]
    top = max(max(row) for row in weights)
    assert {(q, k) for _, q, k, _, _ in view["lines"]} == {
        (q, k) for q in range(6) for k in range(6) if weights[q][k] >= 0.01 * top and weights[q][k] > 0}
    assert all(k <= q for _, q, k, _, _ in view["lines"])  # causal: no line to a later token
    widths = {(q, k): w for _, q, k, w, _ in view["lines"]}
    heaviest = max(widths, key=lambda qk: weights[qk[0]][qk[1]])
    assert widths[heaviest] == max(widths.values())
    starts = head_view_pixels(browser, [(view["x1"], y) for y in view["ys"]])
    assert all(p[3] > 0 for p in starts), "every query's lines start at its label"
    assert head_view_pixels(browser, [(view["x1"], view["ys"][-1] + 15)])[0][3] == 0  # below the last token: nothing
    screenshot(browser.find_element(By.ID, "headview-section"), "explorer-headview.png")
    ActionChains(browser).move_to_element(browser.find_element(By.CSS_SELECTOR, '#headview .query[data-q="4"]')).perform()
    WebDriverWait(browser, 5).until(lambda d: head_view(d)["focus"] == 4)
    assert {q for _, q, _, _, _ in head_view(browser)["lines"]} == {4}
    starts = head_view_pixels(browser, [(view["x1"], y) for y in view["ys"]])
    assert [p[3] > 0 for p in starts] == [q == 4 for q in range(6)], starts
    ActionChains(browser).move_to_element(browser.find_element(By.ID, "readout")).perform()
    WebDriverWait(browser, 5).until(lambda d: head_view(d)["focus"] is None)

    # A bad mask expression: the API's 400 message beside the input, pointing at the token;
    # "Applied:" keeps the mask the heatmaps show, not the text that failed.
    browser.find_element(By.ID, "mask-expression").click()
    help_text = browser.find_element(By.ID, "mask-help").text
    assert all(term in help_text for term in ["&", "|", "strided(", "global(", "window(", "causal"]), help_text
    expression = browser.find_element(By.ID, "mask-text")
    expression.clear()
    expression.send_keys("causal & windw(2)")
    mask_error = browser.find_element(By.ID, "mask-error")
    WebDriverWait(browser, 20).until(lambda d: "found 'windw'" in mask_error.text,
                                     "the mask's error did not appear beside it")
    time.sleep(0.3)  # any answer still in flight for the intermediate texts lands
    assert mask_error.is_displayed() and "column 10, found 'windw'" in mask_error.text
    assert not browser.find_element(By.ID, "error").is_displayed()
    applied = browser.find_element(By.ID, "mask-applied").text
    shown = json.loads(browser.execute_script("return document.body.dataset.request"))
    assert applied != "causal & windw(2)" and applied == server.attention(shown)[1]["mask"]
    before = renders(browser)
    expression.send_keys(Keys.BACKSPACE * len("windw(2)"), "window(2)")
    request = wait_render(browser, before, "fixing the expression")
    WebDriverWait(browser, 20).until(lambda d: json.loads(d.execute_script("return document.body.dataset.request"))["mask"]
                                     == "causal & window(2)")
    assert not mask_error.is_displayed()
    assert browser.find_element(By.ID, "mask-applied").text == "causal & window(2)"


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
    check_page_matches_api(browser, server, request, layer=0)
    # Enter on layer 1's thumbnail shows layer 1 above.
    thumbs[4].send_keys(Keys.ENTER)
    assert Select(browser.find_element(By.ID, "layer")).first_selected_option.text == "layer 1"
    check_page_matches_api(browser, server, request, layer=1)
    screenshot(browser.find_element(By.ID, "overview-section"), "explorer-model-overview.png")
    browser.execute_script("window.scrollTo(0, 0)")
    os.makedirs(SCREENSHOTS, exist_ok=True)
    assert browser.save_screenshot(os.path.join(SCREENSHOTS, "explorer-page.png"))


def set_text(driver, text):
    """Types `text` into the sentence box at once (one input event, as a paste is)."""
    before = renders(driver)
    driver.execute_script("""const t = document.getElementById('text'); t.value = arguments[0];
        t.dispatchEvent(new Event('input', {bubbles: true}));""", text)
    WebDriverWait(driver, 20).until(lambda d: renders(d) > before and json.loads(
        d.execute_script("return document.body.dataset.request"))["text"] == text, f"no redraw for {text!r}")


def test_honest_colours_fixed_scale_stretch_and_masked_cells(server, browser):
    """The fixed 0-1 scale shows the temperature lesson: the same peaked cell is pale at T = 5;
    "stretch" hides it again; a masked pair is hatched grey, unlike a visible weight of 0."""
    browser.get(server.url + "/")
    wait_render(browser, 0, "loading the page")
    set_text(browser, "the cat sat on the mat")
    before = renders(browser)
    browser.find_element(By.CSS_SELECTOR, '[data-temperature="1"]').click()
    request = wait_render(browser, before, "the T = 1 button")
    at_one = check_page_matches_api(browser, server, request)
    head = at_one["weights"][0]
    q, k = max(((i, j) for i in range(6) for j in range(6)), key=lambda ij: head[ij[0]][ij[1]])
    peaked_at_one = cell_pixels(browser, 0)[(q, k)][0]
    assert close(peaked_at_one, ramp(head[q][k]))

    slider = browser.find_element(By.ID, "temperature")
    before = renders(browser)
    slider.send_keys(Keys.END)
    request = wait_render(browser, before, "T = 5")
    hot = check_page_matches_api(browser, server, request)
    peaked_hot = cell_pixels(browser, 0)[(q, k)][0]
    print(f"\npeaked cell ({q}, {k}) of head 0: w = {head[q][k]:.4f} at T = 1 drawn {peaked_at_one}; "
          f"w = {hot['weights'][0][q][k]:.4f} at T = 5 drawn {peaked_hot}")
    assert luminance(peaked_hot) > luminance(peaked_at_one) + 20, (peaked_hot, peaked_at_one)
    assert saturation(peaked_hot) < saturation(peaked_at_one)
    screenshot(browser.find_element(By.ID, "heatmaps-section"), "explorer-hot-fixed.png")

    # Stretched, each panel to its own largest weight: at T = 5 the heads look as dark and
    # varied as at T = 1 again; the option says so on each panel.
    before_pixels = cell_pixels(browser, 0)
    browser.find_element(By.ID, "stretch").click()
    WebDriverWait(browser, 10).until(lambda d: cell_pixels(d, 0) != before_pixels)
    top = max(max(row) for row in hot["weights"][0])
    stretched = cell_pixels(browser, 0)
    hottest = max(((i, j) for i in range(6) for j in range(6)), key=lambda ij: hot["weights"][0][ij[0]][ij[1]])
    assert close(stretched[hottest][0], ramp(1.0))
    assert close(stretched[(q, k)][0], ramp(hot["weights"][0][q][k] / top))
    assert "colours 0 to" in browser.find_element(By.CSS_SELECTOR, '.panel[data-head="0"] .entropy').text
    screenshot(browser.find_element(By.ID, "heatmaps-section"), "explorer-hot-stretched.png")
    browser.find_element(By.ID, "stretch").click()

    # Masked against zero: causal at T = 0.05, where many visible weights are nearly 0 (1e-10 and
    # less: white on the fixed scale).
    before = renders(browser)
    slider.send_keys(Keys.HOME)
    wait_render(browser, before, "T = 0.05")
    before = renders(browser)
    browser.find_element(By.ID, "mask-causal").click()
    request = wait_render(browser, before, "causal")
    cold = check_page_matches_api(browser, server, request)
    w, h, i, j = min((w[i][j], h, i, j) for h, w in enumerate(cold["weights"]) for i in range(6) for j in range(i + 1))
    assert w < 1e-3, "at T = 0.05 some visible weight should be nearly 0"
    whole = cell_pixels(browser, h, centre_only=False)
    assert set(whole[(i, j)]) == {WHITE}, f"a visible weight of {w} is plain white"
    masked = set(whole[(0, 5)])
    assert masked == {MASKED, HATCH}, f"a masked cell is grey with hatching, got {masked}"
    screenshot(browser.find_element(By.ID, "heatmaps-section"), "explorer-masked.png")


HEATMAPS_HEIGHT = "return document.getElementById('heatmaps').scrollHeight"


@pytest.mark.parametrize("tokens, heads", [(16, 8), (64, 16)])
def test_input_to_redraw_time(server, browser, tokens, heads):
    """Input to redraw, as the page measures it (window.qkvLastRedraw, performance.now() from the
    input event): to the end of the drawing (`total`), to the next frame after it (`painted`: the
    browser's layout, paint and compositing too) and to the frame after the head view's lines
    (`complete`). Targets 50 ms at 16 tokens x 8 heads and 100 ms at 64 x 16; asserted loosely
    (the machine is shared, and speed is measured, not tested), the figures printed."""
    browser.get(server.url + "/")
    wait_render(browser, 0, "loading the page")
    if heads != 8:  # 8 is the default
        before = renders(browser)
        Select(browser.find_element(By.ID, "heads")).select_by_visible_text(str(heads))
        wait_render(browser, before, "choosing the heads")
    words = ["the", "cat", "sat", "on", "mat", "and", "a", "dog", "ran", "to", "it", "quickly"]
    set_text(browser, " ".join(words[i % len(words)] for i in range(tokens)))
    slider = browser.find_element(By.ID, "temperature")
    times = []
    for step in range(8):
        before = renders(browser)
        slider.send_keys(Keys.ARROW_RIGHT if step % 2 == 0 else Keys.ARROW_LEFT)
        wait_render(browser, before, "a slider step")
        time.sleep(0.1)  # let a late answer (none expected) settle
        WebDriverWait(browser, 10).until(lambda d: "complete" in d.execute_script("return window.qkvLastRedraw"))
        times.append(browser.execute_script("return window.qkvLastRedraw"))
    request = json.loads(browser.execute_script("return document.body.dataset.request"))
    assert request["heads"] == heads
    answer = check_page_matches_api(browser, server, request)
    assert len(answer["tokens"]) == tokens
    total = [t["total"] for t in times]
    median = statistics.median(total)
    print(f"\n{tokens} tokens x {heads} heads: input to redraw median {median:.0f} ms "
          f"(min {min(total):.0f}, max {max(total):.0f}); server + JSON median "
          f"{statistics.median(t['server'] for t in times):.0f} ms, drawing median "
          f"{statistics.median(t['draw'] for t in times):.0f} ms; to the next frame painted median "
          f"{statistics.median(t['painted'] for t in times):.0f} ms (min {min(t['painted'] for t in times):.0f}, "
          f"max {max(t['painted'] for t in times):.0f}), of which after the answer (painted - server) median "
          f"{statistics.median(t['painted'] - t['server'] for t in times):.0f} ms; with the head view's lines painted median "
          f"{statistics.median(t['complete'] for t in times):.0f} ms; page height "
          f"{browser.execute_script('return document.body.scrollHeight')} px, heatmaps "
          f"{browser.execute_script(HEATMAPS_HEIGHT)} px")
    assert median < 1000 and statistics.median(t["painted"] for t in times) < 1000, times
    g = browser.execute_script("return window.qkvExplorer.geometry()")
    if tokens == 64:
        # Labels thinned so they do not overlap: every k-th token, k * cell >= the text's height.
        assert g["every"] > 1 and g["every"] * g["cell"] >= 11, g
        assert [i for i, _ in g["labels"]] == list(range(0, 64, g["every"]))
        screenshot(browser.find_element(By.ID, "heatmaps-section"), "explorer-64x16.png")
