#include "tools/chart/chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <utility>

namespace tetra::chart {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kFont = 12;   // px: ticks, legend, labels
constexpr double kSmall = 10;  // px: captions inside and under marks

// A coordinate to a tenth of a unit: finer is invisible and makes the page larger.
std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  std::string s(buf);
  if (s.size() > 2 && s.compare(s.size() - 2, 2, ".0") == 0) s.resize(s.size() - 2);
  return s == "-0" ? "0" : s;
}

// About how wide `s` is at `size` px in a sans-serif face (for layout only: what fits,
// where the legend wraps). UTF-8 continuation bytes are not characters.
double text_width(const std::string& s, double size) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return 0.6 * size * static_cast<double>(n);
}

struct Scale {
  double scale;
  const char* suffix;
};

// The unit a value of magnitude `mag` is shown in.
Scale unit_scale(double mag, Unit unit) {
  switch (unit) {
    case Unit::kBytes: {
      static const char* const names[] = {" B", " KiB", " MiB", " GiB", " TiB", " PiB"};
      int k = 0;
      double s = 1;
      while (k < 5 && mag >= s * 1024) {
        s *= 1024;
        ++k;
      }
      return {s, names[k]};
    }
    case Unit::kMilliseconds:
      if (mag >= 1000) return {1000, " s"};
      if (mag > 0 && mag < 1) return {1e-3, " \xc2\xb5s"};
      return {1, " ms"};
    case Unit::kPercent:
      return {1, "%"};
    case Unit::kNumber:
      break;
  }
  if (mag >= 1e10) return {1e9, "G"};
  if (mag >= 1e7) return {1e6, "M"};
  if (mag >= 1e4) return {1e3, "k"};
  return {1, ""};
}

// "2e-5", not "2.0e-05".
std::string short_exponent(double x, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*e", std::max(0, digits), x);
  std::string s(buf);
  const size_t e = s.find('e');
  if (e == std::string::npos) return s;
  const int exp = std::atoi(s.c_str() + e + 1);
  return s.substr(0, e) + "e" + std::to_string(exp);
}

// Black or white, whichever reads on `fill` ("#RRGGBB").
const char* ink_on(const std::string& fill) {
  if (fill.size() != 7 || fill[0] != '#') return "#000000";
  const long v = std::strtol(fill.c_str() + 1, nullptr, 16);
  const double lum = 0.299 * ((v >> 16) & 255) + 0.587 * ((v >> 8) & 255) + 0.114 * (v & 255);
  return lum > 128 ? "#000000" : "#ffffff";
}

std::string text(double x, double y, const std::string& s, const char* anchor = "start",
                 double size = kFont, const char* extra = "") {
  std::string out = "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\"";
  if (std::string(anchor) != "start") out += std::string(" text-anchor=\"") + anchor + "\"";
  if (size != kFont) out += " font-size=\"" + num(size) + "\"";
  return out + extra + ">" + escape(s) + "</text>";
}

std::string rect(double x, double y, double w, double h, const std::string& fill,
                 const std::string& extra = "") {
  return "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + num(std::max(0.0, w)) +
         "\" height=\"" + num(std::max(0.0, h)) + "\" fill=\"" + fill + "\"" + extra;
}

struct LegendEntry {
  enum Style { kLine, kDashed, kMarker, kBox, kPale };
  std::string name, colour;
  Style style;
};

// Title, legend (wrapped to the width) and note; returns where the plot may begin.
double header(std::string& out, const Frame& f, double width,
              const std::vector<LegendEntry>& legend) {
  out += text(12, 20, f.title, "start", 14, " font-weight=\"bold\"");
  double x = 12, y = 20;
  if (!legend.empty()) y += 20;
  for (const auto& e : legend) {
    const double w = 24 + text_width(e.name, kFont) + 14;
    if (x + w > width - 12 && x > 12) {
      x = 12;
      y += 18;
    }
    const std::string mid = num(y - 4);
    switch (e.style) {
      case LegendEntry::kLine:
      case LegendEntry::kDashed:
        out += "<line x1=\"" + num(x) + "\" y1=\"" + mid + "\" x2=\"" + num(x + 18) + "\" y2=\"" +
               mid + "\" stroke=\"" + e.colour + "\" stroke-width=\"2\"" +
               (e.style == LegendEntry::kDashed ? " stroke-dasharray=\"5 3\"" : "") + "/>";
        break;
      case LegendEntry::kMarker:
        out += "<circle cx=\"" + num(x + 9) + "\" cy=\"" + mid + "\" r=\"4\" fill=\"" + e.colour +
               "\"/>";
        break;
      case LegendEntry::kBox:
        out += rect(x + 2, y - 10, 14, 11, e.colour, " stroke=\"#555555\" stroke-width=\"0.5\"/>");
        break;
      case LegendEntry::kPale:
        out +=
            rect(x + 2, y - 10, 14, 11, e.colour,
                 " fill-opacity=\"0.35\" stroke=\"" + e.colour + "\" stroke-dasharray=\"2 1\"/>");
        break;
    }
    out += text(x + 24, y, e.name);
    x += w;
  }
  if (!f.note.empty()) {
    y += 17;
    out += text(12, y, f.note, "start", 11, " fill=\"#444444\"");
  }
  return y + 14;
}

struct Area {
  double l, t, r, b;
  double w() const { return r - l; }
  double h() const { return b - t; }
};

double map(double v, const Ticks& t, double from, double to) {
  const double span = t.hi - t.lo;
  return span > 0 ? from + (v - t.lo) / span * (to - from) : from;
}

// Room for the y tick texts and the axis label.
double left_margin(const Ticks& yt) {
  double w = 0;
  for (double v : yt.at) w = std::max(w, text_width(tick_text(v, yt), kFont));
  return 30 + w;
}

void y_axis(std::string& out, const Area& a, const Ticks& yt, const std::string& label) {
  for (double v : yt.at) {
    const std::string y = num(map(v, yt, a.b, a.t));
    out += "<line x1=\"" + num(a.l) + "\" y1=\"" + y + "\" x2=\"" + num(a.r) + "\" y2=\"" + y +
           "\" stroke=\"#e4e4e4\"/>";
    out += text(a.l - 5, map(v, yt, a.b, a.t) + 4, tick_text(v, yt), "end");
  }
  // Rotated along the plot's height, and no longer than it: a label longer than a short
  // chart's plot ran up into the legend. It gets smaller to fit, down to 9 px, and then
  // takes two lines, broken at the space nearest its middle.
  const double width = text_width(label, kFont);
  const double size = width > a.h() ? std::max(9.0, kFont * a.h() / width) : kFont;
  auto rotated = [&](double x, const std::string& s) {
    out += "<text transform=\"translate(" + num(x) + "," + num((a.t + a.b) / 2) +
           ") rotate(-90)\" text-anchor=\"middle\"" +
           (size < kFont ? " font-size=\"" + num(size) + "\"" : std::string()) + ">" + escape(s) + "</text>";
  };
  const size_t mid = label.size() / 2;
  const size_t before = label.rfind(' ', mid), after = label.find(' ', mid);
  const size_t cut = before == std::string::npos ? after
                     : after == std::string::npos ? before
                     : mid - before <= after - mid ? before
                                                   : after;
  if (width * size / kFont <= a.h() || cut == std::string::npos) {
    rotated(14, label);
  } else {
    rotated(9, label.substr(0, cut));
    rotated(19, label.substr(cut + 1));
  }
}

void x_axis(std::string& out, const Area& a, const Ticks& xt, const std::string& label) {
  double last_right = -kInf;
  for (double v : xt.at) {
    const double x = map(v, xt, a.l, a.r);
    out += "<line x1=\"" + num(x) + "\" y1=\"" + num(a.t) + "\" x2=\"" + num(x) + "\" y2=\"" +
           num(a.b) + "\" stroke=\"#efefef\"/>";
    const std::string s = tick_text(v, xt);
    const double w = text_width(s, kFont);
    if (x - w / 2 < last_right + 6) continue;  // would overlap the previous tick's text
    last_right = x + w / 2;
    const bool edge = x + w / 2 > a.r + 12;  // the last one would run off the chart
    out += text(edge ? a.r + 12 : x, a.b + 15, s, edge ? "end" : "middle");
  }
  out += text((a.l + a.r) / 2, a.b + 32, label, "middle");
}

void frame(std::string& out, const Area& a) {
  out += rect(a.l, a.t, a.w(), a.h(), "none", " stroke=\"#999999\"/>");
}

struct Range {
  double lo = kInf, hi = -kInf;
  void add(double v) {
    if (!std::isfinite(v)) return;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  Ticks ticks(const Axis& axis, int target) const {
    double a = lo, b = hi;
    if (a > b) a = 0, b = 1;  // nothing to show: an empty frame with a scale
    if (axis.zero) a = std::min(a, 0.0), b = std::max(b, 0.0);
    return nice_ticks(a, b, axis.unit, target, axis.integer);
  }
};

const std::string& colour_or(const std::string& c, size_t i) { return c.empty() ? colour(i) : c; }

}  // namespace

Ticks nice_ticks(double lo, double hi, Unit unit, int target, bool integer) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (lo > hi) std::swap(lo, hi);
  if (lo == hi) {  // one value: a band around it (from 0 when it is 0)
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    if (lo != 0) lo -= pad;
    hi += pad;
  }
  Ticks t;
  const Scale s = unit_scale(std::max(std::abs(lo), std::abs(hi)), unit);
  const double a = lo / s.scale, b = hi / s.scale;
  const double raw = (b - a) / std::max(1, target - 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  double step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
  if (integer && s.scale == 1) step = std::max(step, 1.0);
  const double first = std::floor(a / step + 1e-9) * step, last = std::ceil(b / step - 1e-9) * step;
  const long n = std::lround((last - first) / step);
  for (long i = 0; i <= n; ++i) t.at.push_back((first + static_cast<double>(i) * step) * s.scale);
  t.lo = first * s.scale;
  t.hi = last * s.scale;
  t.step = step * s.scale;
  t.scale = s.scale;
  t.suffix = s.suffix;
  t.decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  t.exponent = unit == Unit::kNumber && s.scale == 1 && step < 1e-3;
  return t;
}

std::string tick_text(double value, const Ticks& t) {
  const double step = t.step / t.scale;
  double x = value / t.scale;
  if (std::abs(x) < step * 1e-6) x = 0;
  if (x == 0) return "0";
  if (t.exponent) {  // as few digits as read back as the tick: 5e-5, 1e-4, 1.5e-4
    int digits = 0;
    while (digits < 6 &&
           std::abs(std::strtod(short_exponent(x, digits).c_str(), nullptr) - x) > step * 1e-6)
      ++digits;
    return short_exponent(x, digits) + t.suffix;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", t.decimals, x);
  return std::string(buf) + t.suffix;
}

std::string human(double value, Unit unit) {
  if (!std::isfinite(value)) return "n/a";
  const Scale s = unit_scale(std::abs(value), unit);
  const double x = value / s.scale;
  const double ax = std::abs(x);
  if (unit == Unit::kNumber && s.scale == 1 && ax != 0 && ax < 0.01) return short_exponent(x, 2);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f%s",
                ax >= 100 || (unit == Unit::kBytes && s.scale == 1) ? 0
                : ax >= 10                                          ? 1
                                                                    : 2,
                x, s.suffix);
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + s.size() / 8);
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t' && c != '\r')
          out += "\xef\xbf\xbd";  // U+FFFD: XML has no way to write these
        else
          out += c;
    }
  }
  return out;
}

const std::string& colour(size_t i) {
  static const std::string bright[] = {"#4477AA", "#EE6677", "#228833", "#CCBB44",
                                       "#66CCEE", "#AA3377", "#BBBBBB"};
  return bright[i % (sizeof bright / sizeof bright[0])];
}

std::vector<size_t> keep_extremes(const std::vector<double>& y, size_t max_points) {
  const size_t n = y.size();
  std::vector<size_t> out;
  if (n <= std::max<size_t>(max_points, 3)) {
    for (size_t i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  const size_t buckets = std::max<size_t>(1, (max_points - 2) / 2), none = n;
  out.push_back(0);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t begin = 1 + (n - 2) * b / buckets, end = 1 + (n - 2) * (b + 1) / buckets;
    size_t lo = none, hi = none, gap = none;
    for (size_t i = begin; i < end; ++i) {
      if (!std::isfinite(y[i])) {
        if (gap == none) gap = i;
        continue;
      }
      if (lo == none || y[i] < y[lo]) lo = i;
      if (hi == none || y[i] > y[hi]) hi = i;
    }
    size_t keep[3] = {lo, hi, gap};
    std::sort(keep, keep + 3);
    for (size_t k = 0; k < 3; ++k)
      if (keep[k] != none && keep[k] != out.back()) out.push_back(keep[k]);
  }
  out.push_back(n - 1);
  return out;
}

std::string Chart::svg() const {
  return "<svg class=\"plot\" viewBox=\"0 0 " + std::to_string(width) + " " +
         std::to_string(height) + "\" width=\"" + std::to_string(width) + "\" height=\"" +
         std::to_string(height) + "\" role=\"img\" aria-label=\"" + escape(title) +
         "\" font-family=\"sans-serif\" font-size=\"12\">" + body + "</svg>";
}

std::string compose(const std::string& heading, const std::vector<Chart>& charts) {
  // Rows as wide as the widest chart, filled left to right (two half-width charts share one).
  int row_limit = 0;
  for (const auto& c : charts) row_limit = std::max(row_limit, c.width);
  const int pad = 16, top = 44;
  std::string inner;
  int x = pad, y = top, row_h = 0;
  for (const Chart& c : charts) {
    if (x > pad && x + c.width > pad + row_limit) {
      x = pad;
      y += row_h + pad;
      row_h = 0;
    }
    inner += "<svg x=\"" + std::to_string(x) + "\" y=\"" + std::to_string(y) + "\" width=\"" +
             std::to_string(c.width) + "\" height=\"" + std::to_string(c.height) +
             "\" viewBox=\"0 0 " + std::to_string(c.width) + " " + std::to_string(c.height) +
             "\">" + c.body + "</svg>\n";
    x += c.width + pad;
    row_h = std::max(row_h, c.height);
  }
  const int width = 2 * pad + row_limit, height = y + row_h + pad;
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
         "width=\"" +
         std::to_string(width) + "\" height=\"" + std::to_string(height) + "\" viewBox=\"0 0 " +
         std::to_string(width) + " " + std::to_string(height) +
         "\" font-family=\"sans-serif\" font-size=\"12\">\n" +
         rect(0, 0, width, height, "#ffffff", "/>") +
         text(pad, 28, heading, "start", 18, " font-weight=\"bold\"") + "\n" + inner + "</svg>\n";
}

namespace {

void add_ranges(const std::vector<Series>& series, Range& xr, Range& yr) {
  for (const auto& s : series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i)
      if (std::isfinite(s.y[i])) xr.add(s.x[i]), yr.add(s.y[i]);
}

void add_legend(const std::vector<Series>& series, std::vector<LegendEntry>& legend) {
  for (size_t k = 0; k < series.size(); ++k)
    legend.push_back({series[k].name, colour_or(series[k].colour, k),
                      !series[k].line    ? LegendEntry::kMarker
                      : series[k].dashed ? LegendEntry::kDashed
                                         : LegendEntry::kLine});
}

// A chart of the frame's size on a white ground, with its header; `top`: where the plot may begin.
Chart start(const Frame& f, int height, const std::vector<LegendEntry>& legend, double* top) {
  Chart c{f.title, f.width, height, rect(0, 0, f.width, height, "#ffffff", "/>")};
  *top = header(c.body, f, f.width, legend);
  return c;
}

// A chart with its header, plot area `a` and both axes: what line and stacked charts share.
Chart with_axes(const Frame& f, const std::vector<LegendEntry>& legend, const Ticks& xt,
                const Ticks& yt, Area* a) {
  double top = 0;
  Chart c = start(f, f.height, legend, &top);
  *a = {left_margin(yt), top, f.width - 16.0, f.height - 40.0};
  y_axis(c.body, *a, yt, f.y.label);
  x_axis(c.body, *a, xt, f.x.label);
  return c;
}

// The series as a line broken at its gaps (Note [Many points]), and its markers.
void draw_series(std::string& out, const Series& s, const std::string& col, const Ticks& xt,
                 const Ticks& yt, const Area& a) {
  std::string d, dots;
  size_t finite = 0;
  bool pen = false;
  for (size_t i : keep_extremes(s.y)) {
    if (i >= s.x.size() || !std::isfinite(s.y[i]) || !std::isfinite(s.x[i])) {
      pen = false;
      continue;
    }
    ++finite;
    const std::string px = num(map(s.x[i], xt, a.l, a.r)), py = num(map(s.y[i], yt, a.b, a.t));
    d += (pen ? "L" : "M") + px + " " + py;
    pen = true;
    dots += "<circle cx=\"" + px + "\" cy=\"" + py + "\" r=\"3\"/>";
  }
  const std::string name = " data-series=\"" + escape(s.name) + "\"";
  if (s.line && finite > 1)
    out += "<path class=\"line\"" + name + " d=\"" + d + "\" fill=\"none\" stroke=\"" + col +
           "\" stroke-width=\"1.5\" stroke-linejoin=\"round\"" +
           (s.dashed ? " stroke-dasharray=\"5 3\"" : "") + "/>";
  if ((s.markers || !s.line || finite == 1) && finite)
    out += "<g class=\"markers\"" + name + " fill=\"" + col + "\">" + dots + "</g>";
}

}  // namespace

Chart line_chart(const Frame& f, const std::vector<Series>& series,
                 const std::vector<Rule>& rules) {
  Range xr, yr;
  add_ranges(series, xr, yr);
  for (const auto& r : rules) xr.add(r.x);
  const Ticks xt = xr.ticks(f.x, 8), yt = yr.ticks(f.y, 5);
  std::vector<LegendEntry> legend;
  add_legend(series, legend);
  Area a{};
  Chart c = with_axes(f, legend, xt, yt, &a);
  std::string& out = c.body;
  for (size_t k = 0; k < series.size(); ++k)
    draw_series(out, series[k], colour_or(series[k].colour, k), xt, yt, a);
  for (const auto& r : rules) {
    const double x = map(r.x, xt, a.l, a.r);
    out += "<line class=\"rule\" x1=\"" + num(x) + "\" y1=\"" + num(a.t) + "\" x2=\"" + num(x) +
           "\" y2=\"" + num(a.b) + "\" stroke=\"" + r.colour + "\" stroke-dasharray=\"3 3\"/>";
    const bool right =
        x > a.l + a.w() * 0.7;  // near the right edge the label goes left of the line
    out += text(right ? x - 3 : x + 3, a.t + 11, r.label, right ? "end" : "start", kSmall,
                (" fill=\"" + r.colour + "\"").c_str());
  }
  frame(out, a);
  return c;
}

Chart stacked_steps_chart(const Frame& f, const std::vector<double>& x,
                          const std::vector<Layer>& layers, const std::vector<Series>& lines) {
  const size_t n = x.size();
  std::vector<double> total(n, 0.0);
  for (const auto& l : layers)
    for (size_t i = 0; i < n && i < l.y.size(); ++i)
      if (std::isfinite(l.y[i])) total[i] += l.y[i];
  const std::vector<size_t> idx = keep_extremes(total);
  // Each kept record covers the steps since the one kept before it; the first, one
  // logging interval before it (or from 0).
  std::vector<double> left(idx.size());
  for (size_t j = 0; j < idx.size(); ++j)
    left[j] = j ? x[idx[j - 1]] : x[0] - (n > 1 ? x[1] - x[0] : x[0] > 0 ? x[0] : 1.0);
  Range xr, yr;
  if (n) xr.add(left[0]), xr.add(x[n - 1]);
  for (double t : total) yr.add(t);
  add_ranges(lines, xr, yr);
  const Ticks xt = xr.ticks(f.x, 8), yt = yr.ticks(f.y, 5);
  std::vector<LegendEntry> legend;
  for (size_t k = 0; k < layers.size(); ++k)
    legend.push_back({layers[k].name, colour_or(layers[k].colour, k), LegendEntry::kBox});
  add_legend(lines, legend);
  Area a{};
  Chart c = with_axes(f, legend, xt, yt, &a);
  std::string& out = c.body;
  std::vector<double> below(idx.size(), 0.0);
  for (size_t k = 0; k < layers.size(); ++k) {
    const Layer& l = layers[k];
    std::string up, down;
    std::vector<double> above = below;
    for (size_t j = 0; j < idx.size(); ++j) {
      const double v = idx[j] < l.y.size() && std::isfinite(l.y[idx[j]]) ? l.y[idx[j]] : 0.0;
      above[j] += v;
      const std::string yl = num(map(above[j], yt, a.b, a.t));
      up += (j ? "L" : "M") + num(map(left[j], xt, a.l, a.r)) + " " + yl + "L" +
            num(map(x[idx[j]], xt, a.l, a.r)) + " " + yl;
    }
    for (size_t j = idx.size(); j-- > 0;) {
      const std::string yl = num(map(below[j], yt, a.b, a.t));
      down += "L" + num(map(x[idx[j]], xt, a.l, a.r)) + " " + yl + "L" +
              num(map(left[j], xt, a.l, a.r)) + " " + yl;
    }
    if (!idx.empty())
      out += "<path class=\"layer\" data-series=\"" + escape(l.name) + "\" d=\"" + up + down +
             "Z\" fill=\"" + colour_or(l.colour, k) + "\"/>";
    below = std::move(above);
  }
  for (size_t k = 0; k < lines.size(); ++k)
    draw_series(out, lines[k], colour_or(lines[k].colour, k), xt, yt, a);
  frame(out, a);
  return c;
}

namespace {
double total_of(const Bar& b) {
  double sum = 0;
  for (const auto& s : b.segments) sum += s.value;
  return sum;
}
}  // namespace

Chart bar_chart(const Frame& f, const std::vector<Group>& groups) {
  Range yr;
  double others = 0;  // the tallest bar that sets the scale in any case
  size_t per_group = 1;
  std::vector<LegendEntry> legend;
  auto listed = [&](const std::string& name) {
    return std::any_of(legend.begin(), legend.end(),
                       [&](const LegendEntry& e) { return e.name == name; });
  };
  for (bool pale : {false, true})
    for (const auto& g : groups) {
      per_group = std::max(per_group, g.bars.size());
      for (const auto& b : g.bars) {
        for (const auto& s : b.segments)
          if (b.pale == pale && !listed(s.name))
            legend.push_back({s.name, s.colour, pale ? LegendEntry::kPale : LegendEntry::kBox});
        if (!b.may_clip) others = std::max(others, total_of(b));
      }
    }
  auto clipped = [&](const Bar& b) { return b.may_clip && others > 0 && total_of(b) > 4 * others; };
  for (const auto& g : groups)
    for (const auto& b : g.bars)
      if (!clipped(b)) yr.add(total_of(b));
  const Ticks yt = yr.ticks(f.y, 5);
  double top = 0;
  Chart c = start(f, f.height, legend, &top);
  std::string& out = c.body;
  top += 12;  // room for the notes over the groups
  const Area a{left_margin(yt), top, f.width - 16.0, f.height - 46.0};
  y_axis(out, a, yt, f.y.label);
  const double slot = groups.empty() ? a.w() : a.w() / static_cast<double>(groups.size());
  const double bw = std::min(40.0, slot * 0.8 / static_cast<double>(per_group));
  double last_label = -kInf;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const Group& g = groups[gi];
    const double x0 =
        a.l + slot * static_cast<double>(gi) + (slot - bw * static_cast<double>(g.bars.size())) / 2;
    double highest = a.b, note_left = kInf, note_right = -kInf;  // over the bars that are not cut
    bool captions = false;
    for (size_t bi = 0; bi < g.bars.size(); ++bi) {
      const Bar& b = g.bars[bi];
      const double x = x0 + bw * static_cast<double>(bi);
      double base = 0;
      for (const auto& s : b.segments) {
        const double y0 = std::max(a.t, map(base, yt, a.b, a.t)),
                     y1 = std::max(a.t, map(base + s.value, yt, a.b, a.t));
        base += s.value;
        const std::string tip =
            "<title>" +
            escape(g.label + ", " + b.caption + ": " + s.name + " " + human(s.value, f.y.unit)) +
            "</title></rect>";
        out += rect(x + 1, y1, bw - 2, y0 - y1, s.colour,
                    " class=\"bar\"" +
                        std::string(b.pale ? " fill-opacity=\"0.35\" stroke=\"" + s.colour +
                                                 "\" stroke-dasharray=\"2 1\">"
                                           : ">") +
                        tip);
      }
      if (clipped(b)) {  // a break near the top, and the value it would reach
        for (double dy : {10.0, 15.0})
          out += "<line x1=\"" + num(x) + "\" y1=\"" + num(a.t + dy + 3) + "\" x2=\"" +
                 num(x + bw) + "\" y2=\"" + num(a.t + dy - 3) +
                 "\" stroke=\"#ffffff\" stroke-width=\"2\"/>";
        out += text(x + bw / 2, a.t - 3, human(base, f.y.unit), "middle", kSmall);
      } else {
        highest = std::min(highest, map(base, yt, a.b, a.t));
        note_left = std::min(note_left, x);
        note_right = std::max(note_right, x + bw);
      }
      if (!b.caption.empty() && text_width(b.caption, kSmall) <= bw) {
        out += text(x + bw / 2, a.b + 12, b.caption, "middle", kSmall, " fill=\"#444444\"");
        captions = true;
      }
    }
    if (!g.note.empty() && note_right > note_left)
      out += text((note_left + note_right) / 2, highest - 4, g.note, "middle", kSmall);
    const double cx = a.l + slot * (static_cast<double>(gi) + 0.5), w = text_width(g.label, kFont);
    if (cx - w / 2 > last_label + 6) {
      out += text(cx, a.b + (captions ? 26 : 15), g.label, "middle");
      last_label = cx + w / 2;
    }
  }
  out += text((a.l + a.r) / 2, a.b + 41, f.x.label, "middle");
  frame(out, a);
  return c;
}

Chart timeline_chart(const Frame& f, const std::vector<Row>& rows, const std::vector<Kind>& kinds) {
  Range xr;
  double label_w = 0;
  for (const auto& r : rows) {
    xr.add(r.begin), xr.add(r.end);
    label_w = std::max(label_w, text_width(r.label, kFont));
  }
  const Ticks xt = xr.ticks(f.x, 10);
  std::vector<LegendEntry> legend;
  for (const auto& k : kinds) legend.push_back({k.name, k.colour, LegendEntry::kBox});
  const double row_h = 22, gap = 8;
  std::string head;
  const double head_h = header(head, f, f.width, legend);  // laid out once to know the height
  const double height = head_h + static_cast<double>(rows.size()) * (row_h + gap) + 40;
  double top = 0;
  Chart c = start(f, f.height > 0 ? f.height : static_cast<int>(std::ceil(height)), legend, &top);
  std::string& out = c.body;
  const Area a{label_w + 20, top, f.width - 16.0,
               top + static_cast<double>(rows.size()) * (row_h + gap)};
  x_axis(out, a, xt, f.x.label);
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    const Row& r = rows[ri];
    const double y = a.t + static_cast<double>(ri) * (row_h + gap) + gap / 2;
    out += text(a.l - 8, y + row_h / 2 + 4, r.label, "end");
    const double rx0 = map(r.begin, xt, a.l, a.r), rx1 = map(r.end, xt, a.l, a.r);
    out += rect(rx0, y, rx1 - rx0, row_h, "#ffffff", " stroke=\"#888888\"/>");
    for (const auto& b : r.blocks) {
      const double x0 = map(b.begin, xt, a.l, a.r), x1 = map(b.end, xt, a.l, a.r);
      const std::string& fill = b.kind < kinds.size() ? kinds[b.kind].colour : colour(b.kind);
      const std::string name = b.kind < kinds.size() ? kinds[b.kind].name : "";
      out += rect(x0, y + 1, std::max(0.5, x1 - x0), row_h - 2, fill,
                  " class=\"block\" data-kind=\"" + escape(name) + "\"><title>" +
                      escape(b.label.empty() ? name : b.label + " (" + name + ")") + " " +
                      escape(human(b.end - b.begin, f.x.unit)) + "</title></rect>");
      if (!b.label.empty() && text_width(b.label, kSmall) + 4 <= x1 - x0)
        out += text((x0 + x1) / 2, y + row_h / 2 + 3.5, b.label, "middle", kSmall,
                    (std::string(" fill=\"") + ink_on(fill) + "\"").c_str());
    }
  }
  frame(out, a);
  return c;
}

}  // namespace tetra::chart
