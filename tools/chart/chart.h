// Charts as SVG, drawn here, for pages that must stand alone (`report`): no script, no
// font, style sheet or image from elsewhere. Each chart has a title, axes labelled with
// their unit and "nice" tick values in human units (KiB/MiB/GiB, µs/ms/s, k/M), and a
// legend; text is escaped.
//
// Note [Many points]: a series of more than kMaxPoints points (a 10,000-step run logged
// every step) is drawn from at most about kMaxPoints of them: the first and last, and in
// each of kMaxPoints/2 buckets its lowest and highest point (and its first gap), in order.
// A spike in one step then still shows, where every-nth sampling or a bucket mean would
// hide it, and the SVG stays small and quick to write and to draw.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace tetra::chart {

inline constexpr size_t kMaxPoints = 1000;

enum class Unit { kNumber, kBytes, kMilliseconds, kPercent };

// Tick values covering [lo, hi]: about `target` of them, on 1, 2 or 5 times a power of
// ten of the unit shown (a power of 1024 bytes; µs, ms or s).
struct Ticks {
  double lo = 0, hi = 1, step = 1;
  double scale = 1;    // a tick's text shows value / scale ...
  std::string suffix;  // ... followed by this ("MiB", "ms", "k")
  int decimals = 0;
  bool exponent = false;  // 2e-5 rather than 0.00002
  std::vector<double> at;
};
// `integer`: no step below 1 (steps of training).
Ticks nice_ticks(double lo, double hi, Unit unit, int target = 6, bool integer = false);
// "0.25", "1.5k", "512 MiB", "250 ms", "40%", "2e-5"
std::string tick_text(double value, const Ticks& t);
// The same for a value on its own: three significant digits ("1.23 GiB", "41.5 ms").
std::string human(double value, Unit unit);

// Text for HTML and SVG: & < > " ' escaped, control characters as U+FFFD.
std::string escape(const std::string& text);

// Paul Tol's "bright" scheme: told apart with the common colour-vision deficiencies.
const std::string& colour(size_t i);

// Note [Many points]: the indices of `y` to draw, ascending.
std::vector<size_t> keep_extremes(const std::vector<double>& y, size_t max_points = kMaxPoints);

// One chart: the inside of an <svg> of width x height user units.
struct Chart {
  std::string title;
  int width = 0, height = 0;
  std::string body;
  // <svg class="plot" ...> for an HTML page (scales down with the page).
  std::string svg() const;
};
// The charts under a heading as one SVG document (for a PNG): rows as wide as the widest
// chart, so that two half-width charts share a row.
std::string compose(const std::string& heading, const std::vector<Chart>& charts);

struct Axis {
  std::string label;
  Unit unit = Unit::kNumber;
  bool zero = true;      // the range includes 0
  bool integer = false;  // ticks on whole numbers only (steps)
};
struct Frame {
  std::string title;
  Axis x, y;
  int width = 880, height = 280;  // height 0: as the content needs (timeline)
  std::string note;               // a line under the legend
};

struct Series {
  std::string name;
  std::vector<double> x, y;  // y NaN: a gap in the line
  std::string colour;        // "" = colour(index)
  bool line = true, markers = false, dashed = false;
};
// A vertical line across the plot at x, labelled (a resume, a failed checkpoint).
struct Rule {
  double x;
  std::string label;
  std::string colour = "#555555";
};
Chart line_chart(const Frame& f, const std::vector<Series>& series,
                 const std::vector<Rule>& rules = {});

// Stacked layers over x, where each y is a mean over the steps since the previous x (what
// a metrics record reports): drawn as steps, not slopes. `lines` are drawn over them.
struct Layer {
  std::string name;
  std::vector<double> y;  // one per x; NaN counts as 0
  std::string colour;
};
Chart stacked_steps_chart(const Frame& f, const std::vector<double>& x,
                          const std::vector<Layer>& layers, const std::vector<Series>& lines = {});

// Groups of bars, each bar a stack of segments; a pale bar is an estimate beside a measure.
struct Segment {
  std::string name;
  double value = 0;
  std::string colour;
};
struct Bar {
  std::string caption;  // under the bar, where there is room
  std::vector<Segment> segments;
  bool pale = false;
  // A bar that would dwarf the others (a process's RSS beside its model state) does not
  // set the scale when it is over 4 times the tallest other bar: it is cut at the top,
  // marked with a break and labelled with its value.
  bool may_clip = false;
};
struct Group {
  std::string label;
  std::vector<Bar> bars;
  std::string note;  // over the group ("1.02x")
};
Chart bar_chart(const Frame& f, const std::vector<Group>& groups);

// Rows of blocks on one time axis (a pipeline step, per rank). A row's [begin, end] is
// drawn as an empty frame: what no block covers is idle.
struct Kind {
  std::string name, colour;
};
struct Block {
  double begin, end;
  size_t kind;        // into the kinds
  std::string label;  // drawn inside where it fits
};
struct Row {
  std::string label;
  double begin, end;
  std::vector<Block> blocks;
};
Chart timeline_chart(const Frame& f, const std::vector<Row>& rows, const std::vector<Kind>& kinds);

}  // namespace tetra::chart
