// A caching allocator for torch's large host (CPU) tensors; see host_cache.py.
//
// Each block of at least `min_bytes` is its own anonymous mapping, rounded up to a size class
// (32 classes per power of two). A freed block is kept for the next request of its class, up to
// `cap_bytes` of kept blocks, the least recently freed given back first, and never more than the
// most bytes ever in use less those in use now (a new mapping gives kept blocks back before its
// pages are touched): the blocks in use and kept together stay within the high-water mark of the
// blocks in use. Smaller requests go to the allocator that was installed before (glibc's malloc),
// through the same deleter (torch's raw interface, which oneDNN uses for its scratch buffers,
// needs one). A kept block is reused without the kernel's work for fresh memory (a fault and a
// zeroed page per 4 KiB on first touch, unmapping on free), which is what large short-lived
// tensors cost on the host otherwise.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <list>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace {

struct Stats {
  uint64_t hits = 0;         // requests served by a kept block
  uint64_t misses = 0;       // requests that mapped a new block
  uint64_t released = 0;     // blocks given back to the system
  uint64_t kept_bytes = 0;   // bytes of freed blocks kept now
  uint64_t live_bytes = 0;   // bytes of blocks in use now
  uint64_t peak_live = 0;    // the most bytes in use at once
};

class HostCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* ptr = nullptr;
    if (n < min_bytes_) {
      ptr = fallback_->raw_allocate(n);  // freed through the same deleter, which hands it back
    } else {
      const size_t size = size_class(n);
      ptr = take(size);
      if (ptr == nullptr) {
        ptr = map(size);
      }
      report(ptr, static_cast<int64_t>(size));
    }
    return {ptr, ptr, &HostCache::deleter, c10::Device(c10::DeviceType::CPU)};
  }

  // torch's raw interface (oneDNN's scratch buffers) needs one deleter for every block
  c10::DeleterFnPtr raw_deleter() const override {
    return &HostCache::deleter;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  static HostCache& get() {
    static HostCache* cache = [] {
      auto* made = new HostCache();  // never destroyed: blocks may outlive exit
      // a fork while another thread holds the lock (a DataLoader's workers beside the
      // optimizer's threads) must not leave the child's copy of the lock held
      pthread_atfork(
          [] { get().mutex_.lock(); },
          [] { get().mutex_.unlock(); },
          [] { get().mutex_.unlock(); });
      return made;
    }();
    return *cache;
  }

  void configure(uint64_t cap_bytes, uint64_t min_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    cap_bytes_ = cap_bytes;
    min_bytes_ = min_bytes;
    evict_to(cap_bytes_);
  }

  // the allocator for blocks below min_bytes; it must offer the raw interface
  bool set_fallback(c10::Allocator* fallback) {
    if (fallback == nullptr || fallback->raw_deleter() == nullptr) {
      return false;
    }
    fallback_ = fallback;
    return true;
  }

  c10::Allocator* fallback() const {
    return fallback_;
  }

  void trim() {
    std::lock_guard<std::mutex> lock(mutex_);
    evict_to(0);
  }

  void keep_nothing() {  // from now on a freed block goes back to the system
    std::lock_guard<std::mutex> lock(mutex_);
    cap_bytes_ = 0;
    evict_to(0);
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  struct Kept {
    void* ptr;
    size_t size;
  };

  static size_t size_class(size_t n) {
    size_t top = 4096;
    while (top < n) {
      top <<= 1;
    }
    const size_t step = top >= (size_t{1} << 18) ? top / 64 : 4096;  // 32 classes per octave
    return (n + step - 1) / step * step;
  }

  static void deleter(void* ptr) {
    get().give(ptr);
  }

  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = by_size_.find(size);
    if (found == by_size_.end() || found->second.empty()) {
      return nullptr;
    }
    auto it = found->second.back();
    found->second.pop_back();
    void* ptr = it->ptr;
    lru_.erase(it);
    stats_.kept_bytes -= size;
    stats_.hits += 1;
    note_live(ptr, size);
    return ptr;
  }

  void* map(size_t size) {
    void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      trim();  // the kept blocks may be what the system lacks
      ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (ptr == MAP_FAILED) {
        throw std::bad_alloc();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.misses += 1;
    note_live(ptr, size);
    // kept + live never exceeds the most ever live: the cache does not raise the high-water mark
    evict_to(std::min<uint64_t>(cap_bytes_, stats_.peak_live - stats_.live_bytes));
    return ptr;
  }

  void note_live(void* ptr, size_t size) {
    sizes_[ptr] = size;
    stats_.live_bytes += size;
    if (stats_.live_bytes > stats_.peak_live) {
      stats_.peak_live = stats_.live_bytes;
    }
  }

  void give(void* ptr) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto found = sizes_.find(ptr);
    if (found == sizes_.end()) {  // a block below min_bytes: the fallback's
      lock.unlock();
      fallback_->raw_deleter()(ptr);
      return;
    }
    const size_t size = found->second;
    sizes_.erase(found);
    stats_.live_bytes -= size;
    if (size > cap_bytes_) {
      release(ptr, size);
    } else {
      lru_.push_front(Kept{ptr, size});
      by_size_[size].push_back(lru_.begin());
      stats_.kept_bytes += size;
      evict_to(cap_bytes_);
    }
    lock.unlock();
    report(ptr, -static_cast<int64_t>(size));
  }

  // Tells torch's profiler of a block handed out (size > 0) or given back (size < 0), as torch's
  // own CPU allocator does: without it a profile (and z3 inspect's measured peak) would miss
  // every block of the cache. Called without mutex_ held: the profiler may allocate.
  void report(void* ptr, int64_t size) {
    if (!c10::memoryProfilingEnabled()) {
      return;
    }
    uint64_t live = 0;
    uint64_t reserved = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live = stats_.live_bytes;
      reserved = stats_.live_bytes + stats_.kept_bytes;
    }
    c10::reportMemoryUsageToProfiler(
        ptr, size, live, reserved, c10::Device(c10::DeviceType::CPU));
  }

  void evict_to(uint64_t cap) {  // holds mutex_
    while (stats_.kept_bytes > cap && !lru_.empty()) {
      auto oldest = std::prev(lru_.end());
      auto& same = by_size_[oldest->size];
      for (auto it = same.begin(); it != same.end(); ++it) {
        if (*it == oldest) {
          same.erase(it);
          break;
        }
      }
      stats_.kept_bytes -= oldest->size;
      release(oldest->ptr, oldest->size);
      lru_.erase(oldest);
    }
  }

  void release(void* ptr, size_t size) {  // holds mutex_
    munmap(ptr, size);
    stats_.released += 1;
  }

  std::mutex mutex_;
  c10::Allocator* fallback_ = nullptr;
  uint64_t cap_bytes_ = 0;
  uint64_t min_bytes_ = uint64_t{1} << 20;
  Stats stats_;
  std::list<Kept> lru_;  // front: the most recently freed
  std::unordered_map<size_t, std::vector<std::list<Kept>::iterator>> by_size_;
  std::unordered_map<void*, size_t> sizes_;
};

}  // namespace

extern "C" {

// Installs the cache as torch's CPU allocator; returns 1 if torch now allocates through it.
int zero3_host_cache_install(uint64_t cap_bytes, uint64_t min_bytes) {
  HostCache& cache = HostCache::get();
  cache.configure(cap_bytes, min_bytes);
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != &cache && cache.set_fallback(current)) {
    c10::SetCPUAllocator(&cache, /*priority=*/1);
  }
  return c10::GetCPUAllocator() == &cache ? 1 : 0;
}

// Puts back the allocator the cache replaced and gives back the kept blocks; blocks handed out
// stay valid and go back to the system when freed.
void zero3_host_cache_uninstall() {
  HostCache& cache = HostCache::get();
  if (c10::GetCPUAllocator() == &cache && cache.fallback() != nullptr) {
    c10::SetCPUAllocator(cache.fallback(), /*priority=*/1);
  }
  cache.keep_nothing();
}

void zero3_host_cache_trim() {
  HostCache::get().trim();
}

// hits, misses, released, kept bytes, live bytes, peak live bytes
void zero3_host_cache_stats(uint64_t* out) {
  Stats s = HostCache::get().stats();
  out[0] = s.hits;
  out[1] = s.misses;
  out[2] = s.released;
  out[3] = s.kept_bytes;
  out[4] = s.live_bytes;
  out[5] = s.peak_live;
}

}  // extern "C"
