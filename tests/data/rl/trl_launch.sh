# trl GRPO launched by accelerate with DeepSpeed ZeRO-3 (written for dsdoctor's tests)
accelerate launch --num_processes 8 train_grpo.py --deepspeed zero3.json \
    --model_name_or_path Qwen/Qwen2.5-7B-Instruct --per_device_train_batch_size 4 \
    --max_prompt_length 256 --max_completion_length 256 --ds3_gather_for_generation false --bf16
