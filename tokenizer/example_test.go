package tokenizer_test

import (
	"fmt"

	"github.com/twell-ai/twell/tokenizer"
)

func ExampleTokenizer_Encode() {
	tk, err := tokenizer.Load("testdata/llama2.json.gz")
	if err != nil {
		fmt.Println(err)
		return
	}
	ids, _ := tk.Encode("Hello world", true) // true: add <s>, as Llama 2's template says
	fmt.Println(ids)
	text, _ := tk.Decode(ids, false)
	fmt.Printf("%q\n", text)
	bos, _ := tk.BOS()
	eos, _ := tk.EOS()
	fmt.Println(bos, eos, tk.VocabSize())
	// Output:
	// [1 15043 3186]
	// "<s> Hello world"
	// 1 2 32000
}

func ExampleTokenizer_Decode() {
	tk, err := tokenizer.Load("testdata/gpt2.json.gz")
	if err != nil {
		fmt.Println(err)
		return
	}
	text, err := tk.Decode([]int{15496, 11, 995, 0, 50256}, true) // true: drop <|endoftext|>
	fmt.Printf("%q %v\n", text, err)
	// Output: "Hello, world!" <nil>
}
