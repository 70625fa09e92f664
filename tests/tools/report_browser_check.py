#!/usr/bin/python3
"""A report page as a browser shows it: headless Chromium driven by chromedriver.

    report_browser_check.py REPORT.html SCREENSHOT.png MIN_PLOTS [REPORT.html SCREENSHOT.png MIN_PLOTS]...

Fails (exit 1, each failure on a line of its own, naming the page) when a page refers to anything
outside itself (a script, a src= or href= to another place, a style sheet or font by
URL), the browser logs a SEVERE message, there are fewer than MIN_PLOTS charts
(<svg class="plot">), a chart is not shown, has no size, draws text outside itself or
looks blank in its own screenshot (too few colours, too few pixels off the background),
or the page is wider than the window. Saves a screenshot of each whole page (the window
made as tall as the document) to its SCREENSHOT.png and prints its path and size.
One browser serves every page (it takes about two seconds to start).
Exit 77: selenium, PIL, chromium or chromedriver is missing (the test skips).
"""
import io
import json
import os
import re
import sys

try:
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
except ImportError as e:
    print(f"cannot run: {e} (Debian's python3-selenium and python3-pil)")
    sys.exit(77)

WIDTH = 1280


def external_references(html):
    """What in the page would reach outside it."""
    found = []
    if re.search(r"<script\b", html, re.I):
        found.append("a <script> element")
    for m in re.finditer(r"""\b(src|href|xlink:href|srcset|action)\s*=\s*["']?\s*([^"'\s>]*)""", html, re.I):
        target = m.group(2)
        if not target.startswith("#"):
            found.append(f"{m.group(1)}={target!r}")
    if re.search(r"url\s*\(|@import|<link\b|<iframe\b|<img\b|<object\b|<embed\b", html, re.I):
        found.append("a url(), @import, <link>, <iframe>, <img>, <object> or <embed>")
    return found


def blank(png):
    """Why a chart's screenshot looks blank, or None."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20) or []
    if len(colours) <= 3:
        return f"{len(colours)} distinct colours"
    background = max(colours)[0]
    inked = 1 - background / (img.width * img.height)
    if inked < 0.02:
        return f"only {100 * inked:.1f}% of its pixels differ from the background"
    return None


# Every <text> of each chart that leaves the chart's box (cut off when drawn).
TEXT_OUTSIDE = """
return Array.from(document.querySelectorAll('svg.plot')).map((svg, i) => {
  const box = svg.getBoundingClientRect(), out = [];
  for (const t of svg.querySelectorAll('text')) {
    const b = t.getBoundingClientRect();
    if (b.width === 0) continue;
    if (b.left < box.left - 1 || b.top < box.top - 1 || b.right > box.right + 1 || b.bottom > box.bottom + 1)
      out.push(t.textContent + ' at ' + [b.left - box.left, b.top - box.top, b.width, b.height].map(Math.round).join(','));
  }
  return [i, svg.getAttribute('aria-label'), out];
}).filter(r => r[2].length);
"""


def check(driver, page, screenshot, min_plots):
    """The failures of one page; saves its screenshot."""
    failures = []
    html = open(page, encoding="utf-8").read()
    failures += [f"external reference: {r}" for r in external_references(html)]
    driver.set_window_size(WIDTH, 1000)
    driver.get("file://" + os.path.abspath(page))
    for entry in driver.get_log("browser"):
        if entry.get("level") == "SEVERE":
            failures.append(f"browser console: {entry.get('message')}")
    plots = driver.find_elements(By.CSS_SELECTOR, "svg.plot")
    if len(plots) < min_plots:
        failures.append(f"{len(plots)} charts (svg.plot), expected at least {min_plots}")
    for i, svg in enumerate(plots):
        name = f"chart {i} ({svg.get_attribute('aria-label')})"
        size = svg.size
        if not svg.is_displayed() or size["width"] < 50 or size["height"] < 50:
            failures.append(f"{name}: not shown (displayed {svg.is_displayed()}, size {size})")
            continue
        driver.execute_script("arguments[0].scrollIntoView()", svg)
        why = blank(svg.screenshot_as_png)
        if why:
            failures.append(f"{name}: looks blank: {why}")
    for i, label, texts in driver.execute_script(TEXT_OUTSIDE):
        failures.append(f"chart {i} ({label}): text outside the chart: {'; '.join(texts[:5])}")
    width = driver.execute_script("return document.documentElement.scrollWidth")
    if width > WIDTH:
        failures.append(f"the page is {width} px wide in a {WIDTH} px window")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WIDTH, height)
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(screenshot)
    with Image.open(screenshot) as shot:
        print(json.dumps({"page": page, "screenshot": screenshot, "width": shot.width, "height": shot.height,
                          "plots": len(plots)}))
    return [f"{page}: {f}" for f in failures]


def main():
    args = sys.argv[1:]
    if not args or len(args) % 3:
        print(__doc__)
        return 2
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={WIDTH},1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    failures = []
    try:
        for i in range(0, len(args), 3):
            failures += check(driver, args[i], args[i + 1], int(args[i + 2]))
    finally:
        driver.quit()
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
