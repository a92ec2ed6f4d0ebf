// A progress line for long loops (evaluation windows, training steps):
//   "eval h2o M=64 [######......]  37/120  30.8%  12.3 it/s  elapsed 0:00:03  ETA 0:00:07  window 37"
// On a terminal it redraws one line in place ('\r'), at most ten times a second. Anywhere else (CI logs,
// files, string streams) it prints a full line each time another 10% is done, and one at the end when
// the run stopped short of a 10% step, so logs stay short.
// Thread-compatible: one thread at a time may use an instance.
#pragma once
#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>

namespace kvbound {

class ProgressBar {
 public:
  enum class Mode {
    Auto,         // Interactive when `out` is std::cerr/std::clog on a terminal stderr (or std::cout on a terminal stdout)
    Interactive,  // redraw one line in place
    Log,          // a full line every 10% and at the end
  };

  // total >= 0 units of work; throws std::invalid_argument on a negative total.
  ProgressBar(std::string label, std::int64_t total, std::ostream& out = std::cerr, Mode mode = Mode::Auto);
  ~ProgressBar();  // finishes the line if finish() was not called (e.g. when an exception unwinds)
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Records n more units done (n >= 0, else std::invalid_argument); `status` is shown after the ETA
  // until the next advance replaces it.
  void advance(std::int64_t n = 1, const std::string& status = "");
  // Prints the final state and ends the line; later calls do nothing.
  void finish();

  std::int64_t done() const { return done_; }
  bool interactive() const { return interactive_; }

 private:
  using Clock = std::chrono::steady_clock;
  // One progress line; cut to max_width bytes when max_width > 0.
  std::string render(bool with_bar, int max_width) const;
  void draw_interactive();
  void print_log_line();

  std::string label_;
  std::int64_t total_;
  std::ostream& out_;
  bool interactive_;
  int terminal_fd_;  // the descriptor whose width limits an interactive line; -1 when not interactive
  std::int64_t done_ = 0;
  std::string status_;
  Clock::time_point start_;
  Clock::time_point last_draw_;
  bool drawn_ = false;
  std::int64_t logged_decile_ = 0;     // the last 10% step printed in Log mode
  std::int64_t logged_done_ = -1;      // done_ at the last printed Log line
  bool finished_ = false;
};

// Formats seconds as h:mm:ss ("0:01:05", "12:00:00"); "-:--:--" when unknown (negative or not finite).
std::string format_duration_hms(double seconds);

}  // namespace kvbound
