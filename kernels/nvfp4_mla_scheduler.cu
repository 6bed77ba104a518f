// The decode scheduler: one block writes the work list of the calls that reuse it
// (nvfp4_mla_schedule.cuh holds the scheduling, which an attention kernel also runs for a list of
// its own call).
#include "nvfp4_mla_params.cuh"  // Params: decode_scheduler.SCHEDULER_PARAMS
#include "nvfp4_mla_schedule.cuh"

// One block a call: at least one block an SM lets ptxas use the registers of one (for two 1,024-thread
// blocks it keeps 32 a thread, and spills on sm_80).
extern "C" __global__ void __launch_bounds__(THREADS, 1) nvfp4_mla_decode_scheduler(const Params p) {
    __shared__ ScheduleScratch scratch;
    launch_dependents();
    const schedule_detail::Rows rows = {p.swa_lens, p.extra_lens, p.swa_lens_int64, p.extra_lens_int64, p.swa_k,
                                        p.extra_k,  p.rows};
    // The lengths may come from the stream's previous kernel: dealt across the wait for it.
    write_list(schedule_across_wait(p.schedule, rows, scratch), static_cast<u32>(p.schedule.parts), p.parts_out,
               p.split_rows);
}
