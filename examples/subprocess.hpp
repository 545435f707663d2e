// Starting child processes and waiting for them: the one way the examples and the tests do it
// (POSIX fork + execve; not installed with emakit, included by path).
//
//   emakit_subprocess::Process rank({"/proc/self/exe", "--rank", "1"});   // started
//   const int status = rank.wait();                                        // 0: it exited with 0
//   emakit_subprocess::run({emakit_subprocess::find_program("gnuplot"), "plot.gp"}, {.cwd = out});
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

extern char** environ;

namespace emakit_subprocess {

// How a child starts. Everything is optional; by default it inherits this process's environment,
// working folder, stdout and stderr.
struct Options {
  std::vector<std::string> env{};  // "NAME=value" entries, replacing this process's NAME if it has one
  std::filesystem::path output{};  // when set: the child's stdout and stderr go to this file (truncated)
  bool pipe_stdout = false;        // the child's stdout into a pipe that Process::stdout_fd() reads
  std::filesystem::path cwd{};     // when set: the child's working folder
  bool die_with_parent = false;    // the child is SIGKILLed when this process ends (Linux)
};

// The running program's path, to start copies of it.
inline std::string own_executable() {
  std::error_code ec;
  auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::system_error(ec, "cannot read /proc/self/exe");
  return path.string();
}

// The path of program `name` on PATH, or "" when there is none; a name with a '/' is returned as is.
inline std::string find_program(std::string_view name) {
  if (name.find('/') != std::string_view::npos) return std::string(name);
  const char* path = std::getenv("PATH");
  std::string_view dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    const auto colon = dirs.find(':');
    const std::string dir(dirs.substr(0, colon));
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + std::string(name);
    if (::access(candidate.c_str(), X_OK) == 0 && !std::filesystem::is_directory(candidate)) return candidate;
    if (colon == std::string_view::npos) return "";
    dirs.remove_prefix(colon + 1);
  }
}

// "exit 3", "signal 9": a wait status (as Process::wait() returns it) for messages.
inline std::string describe(int status) {
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// One child process. Statuses are POSIX wait statuses: 0 when it exited with 0, otherwise
// WIFEXITED / WEXITSTATUS and WIFSIGNALED / WTERMSIG tell how it ended. A child still running
// when its Process is destroyed is SIGKILLed and reaped.
class Process {
 public:
  // Starts the program at path args[0] with the arguments `args`. Throws std::system_error when it
  // cannot be started (no such program, no permission, the output file cannot be opened).
  explicit Process(std::vector<std::string> args, const Options& options = {}) {
    if (args.empty()) throw std::invalid_argument("emakit_subprocess::Process: no program given");
    // Everything the child needs is made here: between fork and execve it may only make
    // async-signal-safe calls (this process may have other threads).
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env = options.env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view entry(*e);
      bool replaced = false;
      for (const auto& mine : options.env)
        replaced =
            replaced || entry.substr(0, entry.find('=') + 1) == std::string_view(mine).substr(0, mine.find('=') + 1);
      if (!replaced) env.emplace_back(entry);
    }
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const std::string cwd = options.cwd.string();

    Fd output, out_read, out_write, error_read, error_write;
    if (!options.output.empty()) {
      output.fd = ::open(options.output.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (output.fd < 0)
        throw_errno("cannot open '" + options.output.string() + "' for the output of '" + args[0] + "'");
    }
    if (options.pipe_stdout) make_pipe(out_read, out_write);
    make_pipe(error_read, error_write);  // carries the child's errno when execve fails
    const pid_t parent = ::getpid();

    pid_ = ::fork();
    if (pid_ < 0) throw_errno("cannot start '" + args[0] + "' (fork)");
    if (pid_ == 0) {
      if (options.die_with_parent && (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent)) ::_exit(127);
      if (output.fd >= 0 && (::dup2(output.fd, STDOUT_FILENO) < 0 || ::dup2(output.fd, STDERR_FILENO) < 0))
        child_fail(error_write.fd, 0);
      if (out_write.fd >= 0 && ::dup2(out_write.fd, STDOUT_FILENO) < 0) child_fail(error_write.fd, 0);
      if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) child_fail(error_write.fd, 1);
      ::execve(argv[0], argv.data(), envp.data());
      child_fail(error_write.fd, 2);
    }
    error_write.close();
    int failure[2] = {0, 0};  // what failed in the child (0 dup2, 1 chdir, 2 execve), errno
    ssize_t n;
    while ((n = ::read(error_read.fd, failure, sizeof failure)) < 0 && errno == EINTR) {
    }
    if (n > 0) {
      wait();
      pid_ = -1;
      const char* step = failure[0] == 1   ? "cannot enter the folder '"
                         : failure[0] == 2 ? ""
                                           : "cannot redirect the output '";
      const std::string where = failure[0] == 1 ? cwd : options.output.string();
      throw std::system_error(failure[1], std::generic_category(),
                              "cannot start '" + args[0] + "'" + (*step ? std::string(": ") + step + where + "'" : ""));
    }
    stdout_ = std::exchange(out_read.fd, -1);
  }

  Process(Process&& other) noexcept
      : pid_(std::exchange(other.pid_, -1)), status_(other.status_), stdout_(std::exchange(other.stdout_, -1)) {}
  Process& operator=(Process&& other) noexcept {
    if (this != &other) {
      end();
      pid_ = std::exchange(other.pid_, -1);
      status_ = other.status_;
      stdout_ = std::exchange(other.stdout_, -1);
    }
    return *this;
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() { end(); }

  pid_t pid() const noexcept { return pid_; }
  // The read end of the child's stdout with Options::pipe_stdout, else -1.
  int stdout_fd() const noexcept { return stdout_; }

  // Sends signal `sig` to the child; false when it has already been reaped (wait, try_wait, running).
  bool signal(int sig = SIGKILL) { return pid_ > 0 && !status_ && ::kill(pid_, sig) == 0; }

  // The wait status once the child has ended (reaping it), std::nullopt while it runs.
  std::optional<int> try_wait() {
    if (pid_ > 0 && !status_) {
      int status = 0;
      pid_t r;
      while ((r = ::waitpid(pid_, &status, WNOHANG)) < 0 && errno == EINTR) {
      }
      if (r == pid_) status_ = status;
      if (r < 0) status_ = -1;  // not our child any more: nothing to wait for
    }
    return status_;
  }
  bool running() { return pid_ > 0 && !try_wait(); }

  // Waits for the child to end; its wait status.
  int wait() {
    if (pid_ > 0 && !status_) {
      int status = 0;
      pid_t r;
      while ((r = ::waitpid(pid_, &status, 0)) < 0 && errno == EINTR) {
      }
      status_ = r == pid_ ? status : -1;
    }
    return status_.value_or(-1);
  }

 private:
  struct Fd {  // closes on scope exit
    int fd = -1;
    void close() {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
    ~Fd() { close(); }
  };

  [[noreturn]] static void throw_errno(const std::string& what) {
    throw std::system_error(errno, std::generic_category(), what);
  }
  static void make_pipe(Fd& read_end, Fd& write_end) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw_errno("cannot make a pipe for a child process");
    read_end.fd = fds[0];
    write_end.fd = fds[1];
  }
  [[noreturn]] static void child_fail(int error_fd, int step) {  // async-signal-safe
    const int failure[2] = {step, errno};
    [[maybe_unused]] const auto written = ::write(error_fd, failure, sizeof failure);
    ::_exit(127);
  }

  void end() {
    if (pid_ > 0 && !status_) {
      ::kill(pid_, SIGKILL);
      wait();
    }
    if (stdout_ >= 0) ::close(stdout_);
    stdout_ = -1;
  }

  pid_t pid_ = -1;
  std::optional<int> status_;  // once reaped
  int stdout_ = -1;
};

// Runs the program at path args[0] to its end; its wait status (0: it exited with 0).
inline int run(std::vector<std::string> args, const Options& options = {}) {
  return Process(std::move(args), options).wait();
}

}  // namespace emakit_subprocess
