# Sourced by the scripts/gpu_*.sh scripts (run from the repository root, src/ on PYTHONPATH).

# recipe_fields RECIPE: the recipe's name, output_dir, gpus.per_node and target.aux_layer_ids (SpecForge ids,
# comma-joined, as eval-draft's --aux-ids takes them) on one line (fails if it does not load)
recipe_fields() {
  python3 -c "import sys; from specforge_kimi.online.recipes import load_recipe as l; r = l(sys.argv[1]); \
print(r.name, r.output_dir, r.gpus.per_node, ','.join(map(str, r.target.aux_layer_ids)))" "$1"
}

# eval-draft takes every regenerated held-out row (48 corpus; with MIX + 48 prompt-mix + 48 bench prompts), else 48 corpus
held_out_rows() { if [ -s runs/heldout-regen.jsonl ]; then wc -l < runs/heldout-regen.jsonl; else echo 48; fi; }
