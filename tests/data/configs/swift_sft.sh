NPROC_PER_NODE=4 CUDA_VISIBLE_DEVICES=0,1,2,3 swift sft \
    --model Qwen/Qwen2.5-7B-Instruct --train_type full --dataset AI-ModelScope/alpaca-gpt4-data-en \
    --torch_dtype bfloat16 --deepspeed zero3_offload --per_device_train_batch_size 1
