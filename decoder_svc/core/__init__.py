"""The decoder engine core: the step loop, scheduling, paged KV, the model runner, sampling."""
