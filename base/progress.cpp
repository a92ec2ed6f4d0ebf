#include "base/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <utility>

namespace kvbound {
namespace {

constexpr auto kRedrawInterval = std::chrono::milliseconds(100);
constexpr int kBarWidth = 20;

// The descriptor behind one of the standard streams, or -1 for any other stream.
int standard_stream_fd(const std::ostream& out) {
  if (&out == &std::cerr || &out == &std::clog) return STDERR_FILENO;
  if (&out == &std::cout) return STDOUT_FILENO;
  return -1;
}

// Columns of the terminal behind fd, or 0 when unknown (not a terminal, or a stream without one).
int terminal_width(int fd) {
  winsize size{};
  if (fd >= 0 && ::ioctl(fd, TIOCGWINSZ, &size) == 0) return size.ws_col;
  return 0;
}

std::string format_rate(double units_per_second) {
  char buffer[48];
  if (!std::isfinite(units_per_second) || units_per_second <= 0.0) return "? it/s";
  // Slow loops (a training step a second or more) read better as seconds per unit.
  if (units_per_second < 1.0) {
    std::snprintf(buffer, sizeof buffer, "%.2f s/it", 1.0 / units_per_second);
  } else {
    std::snprintf(buffer, sizeof buffer, units_per_second >= 100.0 ? "%.0f it/s" : "%.1f it/s", units_per_second);
  }
  return buffer;
}

// Cuts `text` to at most `max_bytes` bytes without splitting a UTF-8 sequence.
std::string truncate_utf8(std::string text, std::size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  std::size_t end = max_bytes;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  text.resize(end);
  return text;
}

}  // namespace

std::string format_duration_hms(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0.0) return "-:--:--";
  const auto total = static_cast<long long>(std::llround(seconds));
  char buffer[48];
  std::snprintf(buffer, sizeof buffer, "%lld:%02lld:%02lld", total / 3600, (total / 60) % 60, total % 60);
  return buffer;
}

ProgressBar::ProgressBar(std::string label, std::int64_t total, std::ostream& out, Mode mode)
    : label_(std::move(label)), total_(total), out_(out), start_(Clock::now()), last_draw_(start_) {
  if (total < 0) throw std::invalid_argument("ProgressBar: total must be >= 0, got " + std::to_string(total));
  const int fd = standard_stream_fd(out);
  switch (mode) {
    case Mode::Interactive: interactive_ = true; break;
    case Mode::Log: interactive_ = false; break;
    case Mode::Auto: interactive_ = fd >= 0 && ::isatty(fd) == 1; break;
  }
  terminal_fd_ = interactive_ ? fd : -1;
}

ProgressBar::~ProgressBar() {
  try {
    finish();
  } catch (...) {
    // A destructor must not throw; a failed final progress line loses nothing.
  }
}

void ProgressBar::advance(std::int64_t n, const std::string& status) {
  if (n < 0) throw std::invalid_argument("ProgressBar: advance by a negative amount " + std::to_string(n));
  if (finished_) return;
  done_ += n;
  status_ = status;
  if (interactive_) {
    const Clock::time_point now = Clock::now();
    if (!drawn_ || now - last_draw_ >= kRedrawInterval) draw_interactive();
    return;
  }
  const std::int64_t decile = total_ == 0 ? 10 : std::min<std::int64_t>(10, done_ * 10 / total_);
  if (decile > logged_decile_) {
    logged_decile_ = decile;
    print_log_line();
  }
}

void ProgressBar::finish() {
  if (finished_) return;
  finished_ = true;
  if (interactive_) {
    draw_interactive();
    out_ << '\n' << std::flush;
  } else if (logged_done_ != done_) {
    print_log_line();
  }
}

std::string ProgressBar::render(bool with_bar, int max_width) const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const double fraction = total_ == 0 ? 1.0 : std::clamp(static_cast<double>(done_) / static_cast<double>(total_), 0.0, 1.0);
  const double rate = elapsed > 0.0 ? static_cast<double>(done_) / elapsed : 0.0;
  const double eta = done_ >= total_ ? 0.0 : rate > 0.0 ? static_cast<double>(total_ - done_) / rate : -1.0;

  std::string bar;
  if (with_bar) {
    const int filled = static_cast<int>(fraction * kBarWidth);
    bar = " [" + std::string(filled, '#') + std::string(kBarWidth - filled, '.') + "]";
  }
  char numbers[160];
  std::snprintf(numbers, sizeof numbers, "  %lld/%lld  %.1f%%  %s  elapsed %s  ETA %s", static_cast<long long>(done_),
                static_cast<long long>(total_), 100.0 * fraction, format_rate(rate).c_str(),
                format_duration_hms(elapsed).c_str(), format_duration_hms(eta).c_str());
  const std::string status = status_.empty() ? "" : "  " + status_;
  const std::string line = label_ + bar + numbers + status;
  // Log lines are never cut. A terminal line must not wrap, or '\r' would redraw only its last row: it
  // gives up the status first, then the bar, and only then cuts the numbers.
  if (max_width <= 0 || line.size() <= static_cast<std::size_t>(max_width)) return line;
  const auto width = static_cast<std::size_t>(max_width);
  const std::string without_status = label_ + bar + numbers;
  if (without_status.size() <= width) return without_status + truncate_utf8(status, width - without_status.size());
  return truncate_utf8(label_ + numbers, width);
}

void ProgressBar::draw_interactive() {
  // One column short of the width, as some terminals wrap when the last column is written; "\x1b[K"
  // clears what a longer previous line left to the right.
  const int width = terminal_width(terminal_fd_);
  out_ << '\r' << render(true, width > 0 ? width - 1 : 0) << "\x1b[K" << std::flush;
  last_draw_ = Clock::now();
  drawn_ = true;
}

void ProgressBar::print_log_line() {
  out_ << render(false, 0) << '\n' << std::flush;
  logged_done_ = done_;
}

}  // namespace kvbound
