# OpenRLHF PPO with Ray and vLLM, everything colocated on one node of 8 GPUs (written for dsdoctor's tests)
ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "/openrlhf"}' \
   -- python3 -m openrlhf.cli.train_ppo_ray \
   --ref_num_nodes 1 --ref_num_gpus_per_node 8 \
   --reward_num_nodes 1 --reward_num_gpus_per_node 8 \
   --critic_num_nodes 1 --critic_num_gpus_per_node 8 \
   --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
   --vllm_num_engines 4 --vllm_tensor_parallel_size 2 \
   --colocate_all_models --vllm_gpu_memory_utilization 0.6 \
   --pretrain OpenRLHF/Llama-3-8b-sft-mixture \
   --reward_pretrain OpenRLHF/Llama-3-8b-rm-mixture \
   --micro_train_batch_size 8 --train_batch_size 128 \
   --micro_rollout_batch_size 16 --rollout_batch_size 1024 \
   --prompt_max_len 1024 --generate_max_len 1024 \
   --zero_stage 2 --bf16 --ref_reward_offload \
   --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \
   --init_kl_coef 0.01 --gradient_checkpointing
