swift infer --model Qwen/Qwen2.5-72B-Instruct --infer_backend pt --deepspeed zero3 --max_new_tokens 512
