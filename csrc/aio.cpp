// Asynchronous file I/O engine for tensorstow's SSD tier.
//
// A fixed pool of worker threads runs pread/pwrite on CPU tensors. A request is split
// into `block_size` chunks that the workers take in parallel. Two queues: reads submitted
// with `first` (what a computation waits for) and everything else, in order; a worker takes
// the next `first` chunk before any other, so such a read is not stuck behind a long
// write-back, which only has to finish before its buffer is read again or committed (the
// store orders those itself). The planner's simulator models the same: such a read pauses
// the SSD write in progress (planner/simulate.py `reads_ssd_first`). At most `queue_depth`
// chunks of each queue are queued or in flight at once (a submit blocks, with the GIL
// released, while its queue is full). `wait(handle)` blocks without the GIL until every
// chunk of the request has finished, then raises OSError(errno, "<op> ... at file offset N ...") for
// the first failed chunk. The request keeps a reference to its tensor, so the memory
// stays alive until it is waited for.
//
// io_uring is not used: a thread pool of pread/pwrite measured as fast on the target
// machines (DESIGN.md, Pitfalls) and needs no liburing at build time.
//
// Python API (module `tensorstow_aio`):
//   Engine(num_threads=4, block_size=1 MiB, queue_depth=64)
//   Engine.submit_read(fd, tensor, offset, first=False) -> int   read tensor.nbytes bytes at offset
//   Engine.submit_write(fd, tensor, offset) -> int      write tensor's bytes at offset
//   Engine.wait(handle) -> None                          raises OSError on an I/O error
//   Engine.done(handle) -> bool                          true once wait() won't block
//   Engine.num_threads / block_size / queue_depth        configuration (read-only)
// If `fd` is open with O_DIRECT, the data pointer, the byte count and the offset must all
// be multiples of 4096 (the kernel answers EINVAL otherwise): checked at submit.

#include <torch/extension.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t kDirectAlign = 4096;

struct IoError {
  int code = 0;  // errno; 0 = success
  std::string message;
};

struct Request {
  at::Tensor tensor;  // keeps the memory alive while chunks are in flight
  bool write = false;
  bool first = false;  // queued ahead of the other requests' chunks
  int fd = -1;
  int64_t remaining = 0;  // chunks not yet finished; guarded by Engine::mu_
  IoError error;          // first failure; guarded by Engine::mu_
};

struct Chunk {
  std::shared_ptr<Request> req;
  char* ptr;
  int64_t len;
  int64_t offset;
};

std::string describe(const char* op, int fd, int64_t len, int64_t offset) {
  return std::string(op) + " of " + std::to_string(len) + " bytes at file offset " +
      std::to_string(offset) + " (fd " + std::to_string(fd) + ")";
}

// Runs one chunk to completion (short transfers are continued, EINTR retried).
IoError run_chunk(const Chunk& c) {
  const bool write = c.req->write;
  const int fd = c.req->fd;
  int64_t done = 0;
  while (done < c.len) {
    ssize_t n = write ? ::pwrite(fd, c.ptr + done, c.len - done, c.offset + done)
                      : ::pread(fd, c.ptr + done, c.len - done, c.offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int code = errno;
      return {code, describe(write ? "pwrite" : "pread", fd, c.len, c.offset) +
                        " failed after " + std::to_string(done) + " bytes: " + std::strerror(code)};
    }
    if (n == 0) {
      // pread: end of file; pwrite: the device accepted nothing (treated as full).
      if (write) {
        return {ENOSPC, describe("pwrite", fd, c.len, c.offset) + " wrote nothing after " +
                            std::to_string(done) + " bytes: " + std::strerror(ENOSPC)};
      }
      return {EIO, describe("pread", fd, c.len, c.offset) + " hit end of file after " +
                       std::to_string(done) + " bytes (file too short)"};
    }
    done += n;
  }
  return {};
}

class Engine {
 public:
  Engine(int64_t num_threads, int64_t block_size, int64_t queue_depth)
      : num_threads_(num_threads), block_size_(block_size), queue_depth_(queue_depth) {
    TORCH_CHECK_VALUE(num_threads >= 1 && num_threads <= 256,
                      "aio Engine: num_threads must be in [1, 256], got ", num_threads);
    TORCH_CHECK_VALUE(block_size >= kDirectAlign && block_size % kDirectAlign == 0,
                      "aio Engine: block_size must be a positive multiple of 4096 bytes "
                      "(O_DIRECT alignment), got ", block_size);
    TORCH_CHECK_VALUE(queue_depth >= 1, "aio Engine: queue_depth must be >= 1, got ", queue_depth);
    workers_.reserve(num_threads);
    for (int64_t i = 0; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  ~Engine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();  // workers drain the queue before they exit
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int64_t submit(int64_t fd, const at::Tensor& tensor, int64_t offset, bool write, bool first) {
    const char* op = write ? "submit_write" : "submit_read";
    TORCH_CHECK_VALUE(tensor.device().is_cpu(), "aio ", op, ": tensor must be on the CPU, got ",
                      tensor.device());
    TORCH_CHECK_VALUE(tensor.is_contiguous(), "aio ", op, ": tensor must be contiguous");
    TORCH_CHECK_VALUE(offset >= 0, "aio ", op, ": file offset must be >= 0, got ", offset);
    TORCH_CHECK_VALUE(fd >= 0, "aio ", op, ": invalid file descriptor ", fd);
    const int flags = ::fcntl(static_cast<int>(fd), F_GETFL);
    TORCH_CHECK_VALUE(flags >= 0, "aio ", op, ": fd ", fd, " is not an open file (",
                      std::strerror(errno), ")");
    const int64_t nbytes = static_cast<int64_t>(tensor.numel()) * tensor.element_size();
    char* base = static_cast<char*>(tensor.data_ptr());
    if (flags & O_DIRECT) {
      TORCH_CHECK_VALUE(
          reinterpret_cast<uintptr_t>(base) % kDirectAlign == 0 && nbytes % kDirectAlign == 0 &&
              offset % kDirectAlign == 0,
          "aio ", op, ": fd ", fd, " is open with O_DIRECT, so the data pointer, the byte count "
          "and the file offset must all be multiples of 4096; got pointer ", static_cast<void*>(base),
          ", ", nbytes, " bytes, offset ", offset,
          " (allocate with tensorstow.executor.aio.aligned_empty and pad to 4096)");
    }

    auto req = std::make_shared<Request>();
    req->tensor = tensor;
    req->write = write;
    req->first = first;
    req->fd = static_cast<int>(fd);
    const int64_t nchunks = (nbytes + block_size_ - 1) / block_size_;
    req->remaining = nchunks;

    std::unique_lock<std::mutex> lock(mu_);
    const int64_t handle = next_handle_++;
    requests_.emplace(handle, req);
    std::deque<Chunk>& queue = first ? first_ : rest_;
    int64_t& queued = queued_[first];
    for (int64_t i = 0; i < nchunks; ++i) {
      space_cv_.wait(lock, [&] { return queued < queue_depth_; });
      const int64_t start = i * block_size_;
      queue.push_back(Chunk{req, base + start, std::min(block_size_, nbytes - start), offset + start});
      ++queued;
      work_cv_.notify_one();
    }
    return handle;
  }

  // Blocks until every chunk of `handle` has finished; forgets the handle.
  IoError wait(int64_t handle) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = requests_.find(handle);
    TORCH_CHECK_VALUE(it != requests_.end(), "aio wait: unknown handle ", handle,
                      " (never submitted, or already waited for)");
    std::shared_ptr<Request> req = it->second;
    done_cv_.wait(lock, [&] { return req->remaining == 0; });
    requests_.erase(handle);
    return req->error;
  }

  bool done(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(handle);
    TORCH_CHECK_VALUE(it != requests_.end(), "aio done: unknown handle ", handle,
                      " (never submitted, or already waited for)");
    return it->second->remaining == 0;
  }

  int64_t num_threads() const { return num_threads_; }
  int64_t block_size() const { return block_size_; }
  int64_t queue_depth() const { return queue_depth_; }

 private:
  void worker_loop() {
    for (;;) {
      Chunk chunk;
      bool skip;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [this] { return stop_ || !first_.empty() || !rest_.empty(); });
        if (first_.empty() && rest_.empty()) return;  // stop_ and drained
        std::deque<Chunk>& queue = first_.empty() ? rest_ : first_;
        chunk = std::move(queue.front());
        queue.pop_front();
        skip = chunk.req->error.code != 0;  // the request already failed: don't touch the file
      }
      IoError err = skip ? IoError{} : run_chunk(chunk);
      {
        std::lock_guard<std::mutex> lock(mu_);
        int64_t& queued = queued_[chunk.req->first];
        TORCH_INTERNAL_ASSERT(queued > 0 && chunk.req->remaining > 0);
        --queued;
        if (err.code != 0 && chunk.req->error.code == 0) chunk.req->error = std::move(err);
        --chunk.req->remaining;
      }
      space_cv_.notify_all();  // submitters of either kind may wait
      done_cv_.notify_all();
    }
  }

  const int64_t num_threads_;
  const int64_t block_size_;
  const int64_t queue_depth_;

  std::mutex mu_;
  std::condition_variable work_cv_;   // a chunk was queued, or stop
  std::condition_variable space_cv_;  // a queue has room
  std::condition_variable done_cv_;   // a chunk finished
  std::deque<Chunk> first_, rest_;  // chunks no worker has taken yet
  int64_t queued_[2] = {0, 0};      // rest_ / first_ chunks queued or running
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_handle_ = 1;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

[[noreturn]] void raise_os_error(const IoError& err) {
  // OSError(errno, message): Python picks the matching subclass and sets .errno.
  PyObject* args = Py_BuildValue("(is)", err.code, err.message.c_str());
  PyErr_SetObject(PyExc_OSError, args);
  Py_XDECREF(args);
  throw py::error_already_set();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tensorstow async file I/O engine (thread pool of pread/pwrite)";
  py::class_<Engine>(m, "Engine")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("num_threads") = 4,
           py::arg("block_size") = 1 << 20, py::arg("queue_depth") = 64)
      .def(
          "submit_read",
          [](Engine& e, int64_t fd, const at::Tensor& t, int64_t offset, bool first) {
            return e.submit(fd, t, offset, /*write=*/false, first);
          },
          py::arg("fd"), py::arg("tensor"), py::arg("offset"), py::arg("first") = false,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "submit_write",
          [](Engine& e, int64_t fd, const at::Tensor& t, int64_t offset) {
            return e.submit(fd, t, offset, /*write=*/true, /*first=*/false);
          },
          py::arg("fd"), py::arg("tensor"), py::arg("offset"), py::call_guard<py::gil_scoped_release>())
      .def(
          "wait",
          [](Engine& e, int64_t handle) {
            IoError err;
            {
              py::gil_scoped_release nogil;
              err = e.wait(handle);
            }
            if (err.code != 0) raise_os_error(err);
          },
          py::arg("handle"))
      .def("done", &Engine::done, py::arg("handle"))
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def_property_readonly("block_size", &Engine::block_size)
      .def_property_readonly("queue_depth", &Engine::queue_depth);
}
