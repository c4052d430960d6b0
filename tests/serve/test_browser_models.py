"""The explorer's page on Hugging Face model folders (qkv serve --model DIR) in headless Chromium:
qkv_make_tiny_model's gpt2 and bert folders (QKV_TINY names their parent; serve.cmake sets it).

The model view's thumbnails are drawn (canvas pixels not blank) and open their layer on a click;
the page opens at the layer the API chose by roles; the heatmaps match the API's weights pixel for
pixel; the head view's per-head toggles hide that head's lines and hovering a token keeps only
its lines; hovering a heatmap cell fills the neuron view with the API's score and weight; the
prediction box shows the API's top 5 (next token for GPT-2, the [MASK]'s fills for BERT).
Screenshots go to $QKV_OUT/screenshots, as test_browser.py's do.
"""
import json
import os

import pytest

from conftest import Server
from test_browser import (SCREENSHOTS, WHITE, By, ActionChains, Select, WebDriverWait, browser,  # noqa: F401
                          check_page_matches_api, head_view, head_view_pixels, renders, screenshot)

QKV_TINY = os.environ.get("QKV_TINY", "")


@pytest.fixture
def folders_server():
    if not QKV_TINY or not os.path.isdir(os.path.join(QKV_TINY, "gpt2")):
        pytest.fail(f"QKV_TINY={QKV_TINY!r} does not hold qkv_make_tiny_model's folders; run through ctest")
    s = Server(["--model", os.path.join(QKV_TINY, "gpt2"), "--model", os.path.join(QKV_TINY, "bert")])
    yield s
    code, _, err = s.stop()
    assert code == 0, err


def shown_request(driver):
    return json.loads(driver.execute_script("return document.body.dataset.request || '{}'"))


def open_model(driver, server, model, text):
    """Loads the page, chooses `model`, types `text` (one input event) and waits for its drawing."""
    driver.get(server.url + "/")
    WebDriverWait(driver, 20).until(lambda d: renders(d) > 0, "the page did not draw")
    WebDriverWait(driver, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, f'#source option[value="{model}"]'))
    driver.execute_script("""const t = document.getElementById('text'); t.value = arguments[0];
        const s = document.getElementById('source'); s.value = arguments[1];
        s.dispatchEvent(new Event('change', {bubbles: true}));""", text, model)
    WebDriverWait(driver, 20).until(lambda d: shown_request(d) == {"text": text, "model": model},
                                    f"the page did not draw {model} on {text!r}")
    request = shown_request(driver)
    status, answer = server.attention(request)
    assert status == 200, answer
    return request, answer


def blank(driver, canvas):
    """Whether every pixel of `canvas` is transparent or white."""
    return driver.execute_script("""const c = arguments[0], d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let o = 0; o < d.length; o += 4) if (d[o + 3] > 0 && (d[o] < 250 || d[o + 1] < 250 || d[o + 2] < 250)) return false;
        return true;""", canvas)


def visible_lines(driver, head=None):
    """[(head, query, key)] of the head view's lines drawn (neither they nor their head hidden)."""
    return [(h, q, k) for h, q, k, _, _ in head_view(driver)["lines"] if head is None or h == head]


def test_gpt2_model_view_head_view_neuron_view(folders_server, browser):  # noqa: F811
    server = folders_server
    request, answer = open_model(browser, server, "gpt2", "the cat sat on the mat")
    layers, heads, n = len(answer["layers"]), len(answer["layers"][0]["weights"]), len(answer["tokens"])
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("class") == "pretrained"
    assert not browser.find_element(By.ID, "mask-causal").is_enabled()  # the model brings its own mask

    # The model view: layers x heads thumbnails, drawn, with role badges; opened at the API's first layer.
    thumbs = browser.find_elements(By.CSS_SELECTOR, "#overview canvas.thumb")
    assert len(thumbs) == layers * heads
    assert not any(blank(browser, t) for t in thumbs), "a thumbnail is blank"
    named = [r["role"] for layer in answer["layers"] for r in layer["roles"] if r["role"] != "-"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#overview .badge")) == len(named)
    assert Select(browser.find_element(By.ID, "layer")).first_selected_option.text == f"layer {answer['first_layer']}"
    check_page_matches_api(browser, server, request, layer=answer["first_layer"])
    screenshot(browser.find_element(By.ID, "overview-section"), "explorer-models-model-view.png")

    # A click on another layer's thumbnail opens that layer.
    other = (answer["first_layer"] + 1) % layers
    browser.find_element(By.CSS_SELECTOR, f'#overview canvas.thumb[data-layer="{other}"][data-head="1"]').click()
    assert Select(browser.find_element(By.ID, "layer")).first_selected_option.text == f"layer {other}"
    check_page_matches_api(browser, server, request, layer=other)

    # The prediction box: the API's next-token top 5.
    items = browser.find_elements(By.CSS_SELECTOR, "#prediction li")
    assert len(items) == 5
    top = answer["prediction"]["top"]
    assert [float(i.get_attribute("data-p")) for i in items] == pytest.approx([t["p"] for t in top])
    assert items[0].text.startswith(top[0]["token"])
    # Each bar as long as its probability (styles set through the CSSOM, which the page's CSP allows).
    bars = browser.find_elements(By.CSS_SELECTOR, "#prediction li .bar")
    assert [b.size["width"] for b in bars] == [max(1, round(160 * t["p"])) for t in top]

    # The head view (a canvas): every head overlaid in its own colour; a toggle hides one head's lines.
    weights = answer["layers"][other]["weights"]
    view = head_view(browser)
    colours = {int(h): tuple(c) for h, c in view["colours"].items()}
    assert len(set(colours.values())) == heads
    swatches = browser.find_elements(By.CSS_SELECTOR, "#headview-toggles .swatch")
    assert [browser.execute_script("return getComputedStyle(arguments[0]).backgroundColor", e) for e in swatches] == [
        "rgb({}, {}, {})".format(*colours[h]) for h in range(heads)]
    for h in range(heads):
        expected = {(q, k) for q in range(n) for k in range(n) if weights[h][q][k] >= 0.02}
        assert {(q, k) for _, q, k in visible_lines(browser, h)} == expected
    screenshot(browser.find_element(By.ID, "headview-section"), "explorer-models-head-view.png")
    toggles = [browser.find_element(By.CSS_SELECTOR, f'#headview-toggles input[data-head="{h}"]') for h in range(heads)]
    toggles[0].click()
    assert not visible_lines(browser, 0) and visible_lines(browser, 1)
    # Each head alone: its lines drawn in its colour (read back from the canvas where they start).
    for t in toggles[1:]:
        t.click()
    assert not visible_lines(browser)
    assert all(p[3] == 0 for p in head_view_pixels(browser, [(view["x1"], y) for y in view["ys"]])), "nothing shown"
    for h in range(heads):
        toggles[h].click()
        starts = {q for _, q, _ in visible_lines(browser, h)}
        pixels = head_view_pixels(browser, [(view["x1"], view["ys"][q]) for q in range(n)])
        for q in range(n):
            assert (pixels[q][3] > 0) == (q in starts), (h, q, pixels[q])
            # Opaque enough to tell its colour (8-bit blending of faint lines drifts it a little):
            # nearest this head's of all the heads'.
            if pixels[q][3] > 60:
                distance = {g: sum((a - b) ** 2 for a, b in zip(pixels[q][:3], c)) for g, c in colours.items()}
                assert min(distance, key=distance.get) == h and distance[h] < 25 ** 2, (h, q, pixels[q], colours)
        toggles[h].click()
    for t in toggles[1:]:
        t.click()
    # Hovering a query token keeps only its lines.
    token = browser.find_element(By.CSS_SELECTOR, '#headview .query[data-q="3"]')
    ActionChains(browser).move_to_element(token).perform()
    WebDriverWait(browser, 5).until(lambda d: {q for _, q, _ in visible_lines(d)} == {3})
    pixels = head_view_pixels(browser, [(view["x1"], y) for y in view["ys"]])
    assert [p[3] > 0 for p in pixels] == [q == 3 for q in range(n)]
    screenshot(browser.find_element(By.ID, "headview-section"), "explorer-models-head-view-hover.png")
    toggles[0].click()
    assert visible_lines(browser, 0)

    # The neuron view of a hovered cell: the API's score q.k/sqrt(d) and weight for that pair.
    head, q, k = 2, 4, 1
    canvas = browser.find_element(By.CSS_SELECTOR, f'.panel[data-head="{head}"] canvas')
    g = browser.execute_script("return window.qkvExplorer.geometry()")
    side = canvas.size["width"]
    ActionChains(browser).move_to_element_with_offset(
        canvas, round((k + 0.5) * g["cell"] - side / 2), round((q + 0.5) * g["cell"] - side / 2)).perform()
    WebDriverWait(browser, 10).until(
        lambda d: d.find_element(By.ID, "neuron").get_attribute("data-cell") == json.dumps([other, head, q, k]).replace(" ", ""),
        "the neuron view did not show the hovered cell")
    status, neuron = server.attention({"model": "gpt2", "ids": answer["ids"],
                                       "neuron": {"layer": other, "head": head, "query": q}})
    assert status == 200, neuron
    neuron = neuron["neuron"]
    assert float(browser.find_element(By.ID, "neuron-score").text) == pytest.approx(neuron["scores"][k], rel=1e-3)
    assert float(browser.find_element(By.ID, "neuron-weight").text) == pytest.approx(weights[head][q][k], rel=2e-3, abs=1e-4)
    dot = sum(a * b for a, b in zip(neuron["q"], neuron["k"][k]))
    assert float(browser.find_element(By.ID, "neuron-dot").text) == pytest.approx(dot, rel=1e-3, abs=1e-6)
    rows = browser.find_elements(By.CSS_SELECTOR, "#neuron-table tr[data-key]")
    assert len(rows) == n and "hovered" in rows[k].get_attribute("class")
    assert all("masked" in rows[j].get_attribute("class") for j in range(q + 1, n))  # causal: later keys masked
    screenshot(browser.find_element(By.ID, "neuron-section"), "explorer-models-neuron-view.png")
    browser.execute_script("window.scrollTo(0, 0)")
    os.makedirs(SCREENSHOTS, exist_ok=True)
    assert browser.save_screenshot(os.path.join(SCREENSHOTS, "explorer-models-page.png"))


def test_bert_fills_the_mask(folders_server, browser):  # noqa: F811
    request, answer = open_model(browser, folders_server, "bert", "the cat [MASK] on the mat")
    assert answer["tokens"][0] == "[CLS]" and answer["visible"][0] == "1" * len(answer["tokens"])  # both ways
    check_page_matches_api(browser, folders_server, request, layer=answer["first_layer"])
    fills = answer["prediction"]["masks"]
    assert len(fills) == 1
    items = browser.find_elements(By.CSS_SELECTOR, "#prediction li")
    assert [float(i.get_attribute("data-p")) for i in items] == pytest.approx([t["p"] for t in fills[0]["top"]])
    screenshot(browser.find_element(By.ID, "prediction-section"), "explorer-models-bert-fill.png")
