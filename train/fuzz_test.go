package train

import "testing"

// FuzzParseConfig feeds arbitrary bytes to the training-config parser: it
// must return a config or an error, never panic, and an accepted config
// must be valid.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"model": {"hidden_size": 8, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "hidden_act": "relu"}, "steps": 5, "batch": 2, "seq": 8}`))
	f.Add([]byte(`{"steps": -1}`))
	f.Add([]byte(`{"model": null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("accepted config is invalid: %v", err)
		}
		mc := c.ModelConfig()
		if mc.HiddenSize <= 0 || mc.VocabSize <= 0 || c.Steps <= 0 {
			t.Fatalf("accepted config with hidden %d vocab %d steps %d", mc.HiddenSize, mc.VocabSize, c.Steps)
		}
	})
}
